"""Adapters that run existing agent harnesses on Orchard sandboxes, unchanged.

Each module is an optional extra, imported only when used:

- ``orchard.harness.swerex``: SWE-ReX's ``AbstractDeployment`` and
  ``AbstractRuntime`` (so SWE-agent runs on Orchard by configuration);
  ``pip install orchard-sandbox[swerex]``.
- ``orchard.harness.minisweagent``: mini-swe-agent's ``Environment``;
  ``pip install orchard-sandbox[minisweagent]``.
"""
