"""orchard-executor: the daemon inside every Orchard sandbox.

It serves the versioned HTTP API described in ``orchard_executor.protocol``
(exec, streaming exec, background processes, shell sessions, files), needs
only aiohttp and msgspec, and is started by the sandbox backend::

    python -m orchard_executor --port 0 --token-sha256 HEX --workdir DIR
"""

__version__ = "0.1.0"
