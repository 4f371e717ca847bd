"""Servers for the forward() tests, run inside a sandbox with ``python3 forward_server.py [PORT]``: stdlib only.

On PORT (default: a free one): HTTP (``/hello``; ``/stream``, whose second chunk waits for a file
``go`` in the working directory; ``POST /echo``, the body back; ``/ws``, a
websocket that echoes each message, text upper-cased) and, on a free port,
raw TCP that reads to EOF, then answers with the byte count and closes. Each
raw connection's byte count so far is written to ``received``, and appended
to ``closed.log`` at its end. Once both listen, the
file ``ports`` says "HTTP_PORT RAW_PORT".
"""

import base64
import hashlib
import os
import socket
import socketserver
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def ws_read(rfile):
    """One frame: (opcode, payload), or None at EOF."""
    head = rfile.read(2)
    if len(head) < 2:
        return None
    opcode, size = head[0] & 0x0F, head[1] & 0x7F
    if size == 126:
        (size,) = struct.unpack("!H", rfile.read(2))
    elif size == 127:
        (size,) = struct.unpack("!Q", rfile.read(8))
    mask = rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
    data = bytearray(rfile.read(size))
    for i in range(len(data)):
        data[i] ^= mask[i % 4]
    return opcode, bytes(data)


def ws_frame(opcode, data):
    size = len(data)
    if size < 126:
        head = struct.pack("!BB", 0x80 | opcode, size)
    elif size < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 126, size)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 127, size)
    return head + data


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send_body(self, body, content_type="text/plain"):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/hello":
            self.send_body(b"hello from the sandbox")
        elif self.path == "/stream":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"6\r\nfirst\n\r\n")
            self.wfile.flush()
            while not os.path.exists("go"):
                time.sleep(0.02)
            self.wfile.write(b"7\r\nsecond\n\r\n0\r\n\r\n")
        elif self.path == "/ws":
            accept = base64.b64encode(hashlib.sha1(self.headers["Sec-WebSocket-Key"].encode() + WS_GUID).digest())
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept.decode())
            self.end_headers()
            self.wfile.flush()
            while (msg := ws_read(self.rfile)) is not None:
                opcode, data = msg
                if opcode == 8:  # close
                    self.wfile.write(ws_frame(8, data[:2]))
                    break
                if opcode == 9:  # ping
                    self.wfile.write(ws_frame(10, data))
                elif opcode == 1:
                    self.wfile.write(ws_frame(1, data.upper()))
                elif opcode == 2:
                    self.wfile.write(ws_frame(2, data))
                self.wfile.flush()
            self.close_connection = True
        else:
            self.send_error(404)

    def do_POST(self):
        self.send_body(self.rfile.read(int(self.headers["Content-Length"])), "application/octet-stream")


class Counter(socketserver.BaseRequestHandler):
    def handle(self):
        total = 0
        try:
            while data := self.request.recv(65536):
                total += len(data)
                with open("received.tmp", "w") as f:
                    f.write(str(total))
                os.rename("received.tmp", "received")
            self.request.sendall(str(total).encode())
            self.request.shutdown(socket.SHUT_WR)
        finally:
            with open("closed.log", "a") as f:
                f.write(f"{total}\n")


class Raw(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


if __name__ == "__main__":
    raw = Raw(("127.0.0.1", 0), Counter)
    threading.Thread(target=raw.serve_forever, daemon=True).start()
    http = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 0), Handler)
    with open("ports.tmp", "w") as f:
        f.write(f"{http.server_port} {raw.server_address[1]}")
    os.rename("ports.tmp", "ports")
    http.serve_forever()
