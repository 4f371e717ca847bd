"""Clients run inside the sandbox by tests/test_reverse_forward.py (python3, stdlib only).

python3 reverse_client.py get PORT PATH       print the body of an HTTP/1.0 GET
python3 reverse_client.py sse PORT N          N streams at once; each acks its first event; print JSON
python3 reverse_client.py ws PORT WORD...     a websocket: send each word, print each reply
python3 reverse_client.py recv PORT           send a request, print how the connection ended
python3 reverse_client.py hold PORT           GET /hold; write "holding" once the first line came,
                                              then "hold.out" with how the connection ended
python3 reverse_client.py probe PORT          print "refused" or "open"
python3 reverse_client.py many PORT N         N connections at once, each GET /hold, closed once it ends
"""

import base64
import json
import os
import socket
import struct
import sys
import threading

TIMEOUT = 60


def request(port, path):
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    s.sendall(f"GET {path} HTTP/1.0\r\nHost: client\r\n\r\n".encode())
    f = s.makefile("rb")
    status = f.readline().decode()
    while f.readline() not in (b"\r\n", b""):
        pass
    return s, f, status


def ending(f):
    """How a connection ended: "eof" after whatever data, "reset", or "timeout" (a hang)."""
    try:
        while f.read1(65536):
            pass
    except TimeoutError:
        return "timeout"
    except ConnectionError:  # reset or aborted
        return "reset"
    except OSError as exc:
        return repr(exc)
    return "eof"


def sse(port, n):
    out = {}

    def one(i):
        try:
            s, f, status = request(port, f"/sse?i={i}")
            first = f.readline().decode()
            f.readline()
            a, af, _ = request(port, "/ack")  # the server goes on only once all N have their first event
            af.read()
            af.close()  # the socket's fd stays open while its file does
            a.close()
            out[i] = [status.split()[1], first, f.read().decode()]
            s.close()
        except OSError as exc:
            out[i] = ["error", repr(exc), ""]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(out))


def ws(port, words):
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(
        (
            f"GET /ws HTTP/1.1\r\nHost: client\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    f = s.makefile("rb")
    print(f.readline().decode().split()[1])
    while f.readline() not in (b"\r\n", b""):
        pass
    for word in words:
        data, mask = word.encode(), os.urandom(4)
        size = bytes([0x80 | len(data)]) if len(data) < 126 else bytes([0x80 | 126]) + struct.pack("!H", len(data))
        s.sendall(b"\x81" + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
        _, b2 = f.read(2)
        n = b2 & 0x7F
        if n == 126:
            n = struct.unpack("!H", f.read(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", f.read(8))[0]
        print(f.read(n).decode())


def main():
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "get":
        print(request(port, sys.argv[3])[1].read().decode(), end="")
    elif mode == "sse":
        sse(port, int(sys.argv[3]))
    elif mode == "ws":
        ws(port, sys.argv[3:])
    elif mode == "recv":
        # Nothing sent: a close without unread data is an EOF unless the executor resets it on purpose.
        s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        print(ending(s.makefile("rb")))
    elif mode == "hold":
        _, f, _ = request(port, "/hold")
        f.readline()
        open("holding", "w").close()
        result = ending(f)
        with open("hold.tmp", "w") as out:
            out.write(result)
        os.rename("hold.tmp", "hold.out")
    elif mode == "probe":
        try:
            socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()
            print("open")
        except ConnectionRefusedError:
            print("refused")
    elif mode == "many":
        endings = set()

        def one():
            s, f, _ = request(port, "/hold")
            endings.add(ending(f))
            f.close()
            s.close()

        threads = [threading.Thread(target=one) for _ in range(int(sys.argv[3]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(sorted(endings))


if __name__ == "__main__":
    main()
