"""Quickstart: one sandbox, a few commands, a file round trip, a shell session.

Runs on the embedded ``local`` backend with nothing else installed::

    python examples/quickstart.py
"""

import asyncio

import orchard


async def main() -> None:
    async with orchard.Client() as client, client.sandbox() as sb:
        print(f"sandbox {sb.id} ready in {sb.timings['executor_ready'] * 1000:.0f} ms")

        # A command: exit code, separate stdout and stderr.
        r = await sb.exec("echo hello; echo oops >&2; exit 3")
        print(r.exit_code, repr(r.stdout), repr(r.stderr))

        # A real timeout: the whole process group is killed, partial output kept.
        r = await sb.exec("echo started; sleep 60", timeout=1)
        print("timed out:", r.timed_out, repr(r.stdout))

        # Files in and out.
        await sb.write_file("app/main.py", "print(sum(range(10)))\n")
        r = await sb.exec(["python3", "app/main.py"])
        print("main.py says", r.stdout.strip())
        print("listing:", [entry.name for entry in await sb.list_dir("app")])

        # A shell session keeps cwd and variables between commands.
        async with await sb.shell() as sh:
            await sh.exec("cd app && export GREETING=hi")
            r = await sh.exec('echo "$GREETING from $(pwd)"')
            print(r.stdout.strip())

        # Output as it is produced.
        async for event in sb.exec_stream("for i in 1 2 3; do echo line $i; sleep 0.1; done"):
            if isinstance(event, orchard.OutputEvent):
                print("streamed:", event.data.decode().strip())
            else:
                print("exit code:", event.result.exit_code)

        # A background process.
        proc = await sb.start_process("sleep 0.2; echo done")
        status = await proc.wait(timeout=10)
        print("background:", status.exit_code, (await proc.output()).decode().strip())


if __name__ == "__main__":
    asyncio.run(main())
