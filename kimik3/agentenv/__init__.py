"""AgentENV: isolated sandboxes for agentic RL that pause at zero CPU, fork for judging and checkpoint
incrementally, built on Linux namespaces, cgroups and overlayfs (see ``docs/agentenv.md``).

Modules: ``sandbox`` (the ``Sandbox`` API), ``isolation`` (namespaces, mounts, pid 1), ``image`` (the
read-only base), ``layers`` (the writable layer, copies and incremental checkpoints), ``cgroups``
(limits, freezing, accounting), ``network`` (the loopback allow-list), ``pool`` (``SandboxPool``:
many paused sandboxes in a memory budget), ``zygote`` (REPLs forked from one preloaded process),
``facilities`` (what the machine must give), ``syscalls`` (the Linux calls Python lacks).
"""

from kimik3.agentenv.facilities import MissingFacility
from kimik3.agentenv.sandbox import ExecResult, Limits, Sandbox, SandboxError

__all__ = ["ExecResult", "Limits", "MissingFacility", "Sandbox", "SandboxError"]
