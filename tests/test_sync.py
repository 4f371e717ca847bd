"""orchard.sync: every Sandbox method through the facade, from plain code and inside a running loop.

Local backends (``BACKENDS``); Ctrl-C and interpreter exit are real
subprocesses, checked on the local backend's processes and directories.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import orchard
import orchard.sync
from orchard.errors import PathNotFound, SandboxClosed, SyncLoopError
from orchard_executor.protocol import ExitEvent, OutputEvent
from support import BACKENDS, host_pid_alive, unisolated_ok

pytestmark = [pytest.mark.executor, pytest.mark.filterwarnings("ignore::orchard.errors.UnisolatedWarning")]


def config(backend: str, root: Path) -> orchard.LocalConfig:
    return orchard.LocalConfig(root=str(root), isolation="none" if backend == "local" else "bwrap")


@pytest.fixture(params=BACKENDS)
def client(request: pytest.FixtureRequest, local_root: Path) -> Iterator[orchard.sync.Client]:
    with unisolated_ok(), orchard.sync.Client(config(request.param, local_root)) as client:
        yield client


@pytest.fixture
def sb(client: orchard.sync.Client) -> Iterator[orchard.sync.Sandbox]:
    with client.sandbox() as sb:
        yield sb


def executors_under(root: Path) -> list[int]:
    """Live processes whose command line mentions ``root``: the sandboxes' executors."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if str(root).encode() in f.read() and host_pid_alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def exercise(sb: orchard.sync.Sandbox, local: Path) -> None:
    """Every Sandbox method (and Shell's and Process's), through the facade, with checks."""
    # Commands
    r = sb.exec("echo out; echo err >&2; exit 3", env={"A": "1"})
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert sb.exec(["sh", "-c", "echo $A"], env={"A": "x"}).stdout == "x\n"
    assert sb.exec("cat", stdin="typed").stdout == "typed"
    # A sync iterator where the async API takes an async one, beyond the inline size (streamed).
    chunks = [bytes([i]) * 300_000 for i in range(5)]
    assert sb.exec("wc -c", stdin=iter(chunks)).stdout.strip() == "1500000"
    events = list(sb.exec_stream("echo a; echo b >&2"))
    assert events[:-1] == [OutputEvent(stream="stdout", data=b"a\n"), OutputEvent(stream="stderr", data=b"b\n")]
    assert isinstance(events[-1], ExitEvent)
    assert events[-1].result.exit_code == 0
    proc = sb.start_process("cat; echo done >&2")
    assert isinstance(proc, orchard.sync.Process)
    assert proc.pid > 0
    assert proc.status().running
    proc.write_stdin("hello", close=True)
    assert proc.wait(timeout=30).exit_code == 0
    assert proc.output() == b"hello"
    assert proc.output("stderr") == b"done\n"
    assert proc.read("stdout", offset=2).data == b"llo"
    assert proc.id in [p.id for p in sb.processes()]
    sleeper = sb.start_process("sleep 300")
    assert sleeper.signal(signal.SIGTERM).id == sleeper.id
    assert sleeper.wait(timeout=30).signal == signal.SIGTERM
    assert sleeper.kill().id == sleeper.id
    with sb.shell() as sh:
        assert isinstance(sh, orchard.sync.Shell)
        sh.exec("cd /tmp; X=kept")
        assert sh.exec("echo $PWD $X").stdout == "/tmp kept\n"
    other = sb.shell()
    other.exec("true")
    other.close()
    assert sb.info().version
    # Files
    assert sb.write_file("f.txt", "text").size == 4
    assert sb.write_file("gen.bin", (bytes([i]) * 1000 for i in range(3))).size == 3000
    assert sb.read_file("gen.bin") == b"\0" * 1000 + b"\1" * 1000 + b"\2" * 1000
    assert b"".join(sb.stream_file("f.txt")) == b"text"
    assert sb.stat("f.txt").type == "file"
    assert sb.exists("f.txt")
    assert not sb.exists("nope")
    assert sb.mkdir("d/e").type == "directory"
    assert [e.name for e in sb.list_dir("d")] == ["e"]
    sb.remove("d", recursive=True)
    assert not sb.exists("d")
    (local / "tree").mkdir()
    (local / "tree" / "x.txt").write_text("x")
    (local / "one.txt").write_text("one")
    sb.upload(local / "tree", "up")
    sb.upload(local / "one.txt", "up/one.txt")
    sb.download("up", local / "down")
    assert (local / "down" / "x.txt").read_text() == "x"
    assert (local / "down" / "one.txt").read_text() == "one"
    sb.download("f.txt", local / "f.txt")
    assert (local / "f.txt").read_text() == "text"
    with tarfile.open(fileobj=io.BytesIO(b"".join(sb.download_tar("up")))) as tar:
        assert sorted(tar.getnames()) == ["one.txt", "x.txt"]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("t.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    sb.upload_tar("untarred", buf.getvalue())
    assert sb.read_file("untarred/t.txt") == b"hi"
    snap = sb.snapshot(["untarred"])
    sb.remove("untarred", recursive=True)
    sb.restore(snap)
    assert sb.read_file("untarred/t.txt") == b"hi"
    # The async API's errors, as they are.
    with pytest.raises(PathNotFound):
        sb.read_file("nope")


def test_every_method_from_plain_code(sb: orchard.sync.Sandbox, tmp_path: Path) -> None:
    exercise(sb, tmp_path)


async def test_every_method_inside_a_running_loop(sb: orchard.sync.Sandbox, tmp_path: Path) -> None:
    # This test is a coroutine on pytest-asyncio's running loop: the calls block it, and work.
    asyncio.get_running_loop()
    exercise(sb, tmp_path)


def test_every_public_async_method_has_a_sync_form(sb: orchard.sync.Sandbox, client: orchard.sync.Client) -> None:
    for sync_obj, async_type in ((sb, orchard.Sandbox), (client, orchard.Client)):
        for name, member in inspect.getmembers(async_type):
            if name.startswith("_") or not callable(member):
                continue
            sync_name = "close" if name == "aclose" else name
            assert callable(getattr(sync_obj, sync_name)), name
            if inspect.iscoroutinefunction(member) or hasattr(member, "__wrapped__"):
                # Adapted, not the async method itself.
                assert getattr(sync_obj, sync_name) != getattr(sync_obj._target, name), name
    # The typed forms show the async signatures.
    assert inspect.signature(sb.exec) == inspect.signature(sb._target.exec)


def test_handle_attach_and_forward(client: orchard.sync.Client, sb: orchard.sync.Sandbox, local_root: Path) -> None:
    sb.write_file("www/index.html", "served")
    server = sb.start_process("exec python3 -m http.server 8123 --bind 127.0.0.1", cwd="www")
    # The tunnel is served by the loop thread while this thread makes the request.
    with sb.forward(8123, wait=30) as url, urllib.request.urlopen(f"{url}/index.html", timeout=30) as reply:
        assert reply.read() == b"served"
    server.kill()
    with unisolated_ok(), orchard.sync.Client(client.config) as other:
        attached = other.attach(sb.handle())
        assert isinstance(attached, orchard.sync.Sandbox)
        assert attached.id == sb.id
        assert attached.read_file("www/index.html") == b"served"
    # Not the attaching client's to delete.
    assert sb.exec("echo still").stdout == "still\n"


def test_leaving_a_stream_early_kills_the_command_and_reads_nothing_ahead(sb: orchard.sync.Sandbox) -> None:
    stream = sb.exec_stream("echo $$ > pid; echo ready; exec sleep 300")
    first = next(stream)
    # A facade that read the stream to its end would still be waiting on the sleep.
    assert first == OutputEvent(stream="stdout", data=b"ready\n")
    pid = int(sb.read_file("pid"))
    assert sb.exec(f"kill -0 {pid}").exit_code == 0
    stream.close()  # type: ignore[attr-defined]
    assert sb.exec(f"while kill -0 {pid} 2>/dev/null; do sleep 0.05; done; echo gone", timeout=30).stdout == "gone\n"


def test_after_close_calls_raise_sandbox_closed(client: orchard.sync.Client) -> None:
    sb = client.create()
    sb.exec("true")
    sb.close()
    sb.close()  # twice is fine
    with pytest.raises(SandboxClosed):
        sb.exec("true")
    client.close()
    with pytest.raises(SandboxClosed):
        client.create()


def test_client_close_deletes_the_sandboxes_it_started(local_root: Path) -> None:
    with unisolated_ok():
        client = orchard.sync.Client(config("local", local_root))
    sandboxes = [client.create() for _ in range(2)]
    assert len(executors_under(local_root)) == 2
    client.close()
    assert executors_under(local_root) == []
    assert os.listdir(local_root) == []
    with pytest.raises(SandboxClosed):
        sandboxes[0].exec("true")


def test_a_dead_loop_gives_typed_errors_and_a_new_client_a_new_loop(local_root: Path) -> None:
    with unisolated_ok():
        client = orchard.sync.Client(config("local", local_root))
    sb = client.create()
    waiting: list[BaseException] = []

    def wait_on_a_command() -> None:
        try:
            sb.exec("sleep 300")
        except BaseException as exc:
            waiting.append(exc)

    waiter = threading.Thread(target=wait_on_a_command)
    waiter.start()
    sb.exec("true")  # the loop answers while the other call waits

    def die() -> None:
        raise SystemExit("killed by the test")

    old = sb._loop
    try:
        old.loop.call_soon_threadsafe(die)
        old.thread.join(30)
        waiter.join(30)
        assert [type(e) for e in waiting] == [SyncLoopError]
        with pytest.raises(SyncLoopError, match="died"):
            sb.exec("true")
        with pytest.raises(SyncLoopError):
            client.create()
        with unisolated_ok(), orchard.sync.Client(config("local", local_root / "new")) as fresh:
            assert fresh._loop is not old
            with fresh.sandbox() as sb2:
                assert sb2.exec("echo alive").stdout == "alive\n"
    finally:
        # The dead loop's sandbox: delete it by driving that loop here.
        old.loop.run_until_complete(client._target.aclose())
    assert executors_under(local_root) == []


def test_a_call_on_the_loop_thread_raises_instead_of_waiting_for_itself(sb: orchard.sync.Sandbox) -> None:
    async def sync_call_from_the_loop() -> None:
        sb.exec("true")

    with pytest.raises(SyncLoopError, match="own loop thread"):
        sb._loop.run(sync_call_from_the_loop())


def test_the_sandbox_shortcut(local_root: Path) -> None:
    with unisolated_ok(), orchard.sync.sandbox(backend=config("local", local_root)) as sb:
        assert sb.exec("echo hi").stdout == "hi\n"
        assert len(executors_under(local_root)) == 1
    assert executors_under(local_root) == []


def test_import_orchard_does_not_import_sync() -> None:
    code = "import sys, orchard; assert 'orchard.sync' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_orchard_sync_is_reachable_after_import_orchard_alone() -> None:
    # As the README writes it: `import orchard`, then `orchard.sync.Client(...)`, with no `import orchard.sync`.
    code = (
        "import sys, orchard; assert 'orchard.rollout' not in sys.modules; c = orchard.sync.Client; "
        "r = orchard.rollout.run; assert 'orchard.sync' in sys.modules; orchard.no_such_thing"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert "module 'orchard' has no attribute 'no_such_thing'" in run.stderr, run.stderr


# Real processes: Ctrl-C and interpreter exit. Each script checks, while its
# own interpreter is still alive, that no sandbox remains (the local executor
# exits with its client too, so checking after the exit would prove nothing).
PRELUDE = """
import json, os, sys, time, warnings
warnings.simplefilter("ignore")
ROOT = sys.argv[1]

def executors():
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if ROOT.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found

def left():
    return {"executors": executors(), "dirs": sorted(os.listdir(ROOT)) if os.path.exists(ROOT) else []}

def report(**fields):
    print(json.dumps(fields), flush=True)
"""


def run_script(body: str, root: Path, *, interrupt_when: str | None = None) -> tuple[list[dict[str, object]], str]:
    """Run a script; send SIGINT once it prints a line with ``interrupt_when``; its JSON lines and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + body, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(json.loads(line))
            if interrupt_when and interrupt_when in line:
                proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
        proc.wait()
    return lines, err


def test_ctrl_c_during_an_exec_cancels_it_and_the_with_block_deletes_the_sandbox(local_root: Path) -> None:
    body = """
import orchard, orchard.sync
try:
    with orchard.sync.Client(orchard.LocalConfig(root=ROOT, isolation="none")) as client, client.sandbox() as sb:
        report(step="started", **left())
        sb.exec("sleep 300")
    report(step="not interrupted")
except KeyboardInterrupt:
    report(step="interrupted", **left())
"""
    lines, err = run_script(body, local_root, interrupt_when='"started"')
    assert [line["step"] for line in lines] == ["started", "interrupted"], err
    assert len(lines[0]["executors"]) == 1
    assert len(lines[0]["dirs"]) == 1
    assert lines[1] == {"step": "interrupted", "executors": [], "dirs": []}, err


def test_ctrl_c_while_a_sandbox_starts_leaves_none_behind(local_root: Path, tmp_path: Path) -> None:
    # An "executor" that never gets ready, so the interrupt lands while the sandbox is being created.
    marker = tmp_path / "spawned"
    slow = tmp_path / "slow-python"
    slow.write_text(f"#!/bin/sh\necho $$ > {marker}.tmp && mv {marker}.tmp {marker}\nexec sleep 300\n")
    slow.chmod(0o755)
    body = f"""
import orchard, orchard.sync
try:
    config = orchard.LocalConfig(root=ROOT, isolation="none", python={str(slow)!r})
    with orchard.sync.Client(config) as client:
        report(step="creating")
        with client.sandbox(start_timeout=600):
            report(step="created")
except KeyboardInterrupt:
    report(step="interrupted", spawned=int(open({str(marker)!r}).read()), **left())
"""
    # Interrupt once the slow executor is spawned: the create call is then waiting on it.
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + body, str(local_root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["step"] == "creating"
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1]
            threading.Event().wait(0.02)
        spawned = int(marker.read_text())
        assert host_pid_alive(spawned)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
        proc.wait()
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines == [{"step": "interrupted", "spawned": spawned, "executors": [], "dirs": []}], err
    assert not host_pid_alive(spawned)


def test_sandboxes_of_an_unclosed_client_are_deleted_at_interpreter_exit(local_root: Path) -> None:
    body = """
import atexit
# Registered before orchard.sync's handler, so it runs after it (atexit is last in, first out).
atexit.register(lambda: report(step="at exit", **left()))
import orchard, orchard.sync
client = orchard.sync.Client(orchard.LocalConfig(root=ROOT, isolation="none"))
sandboxes = [client.create(), client.create()]
report(step="started", **left())
"""
    lines, err = run_script(body, local_root)
    assert [line["step"] for line in lines] == ["started", "at exit"], err
    assert len(lines[0]["executors"]) == 2  # type: ignore[arg-type]
    assert lines[1] == {"step": "at exit", "executors": [], "dirs": []}, err
