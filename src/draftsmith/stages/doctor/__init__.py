"""``draftsmith doctor``: every target/drafter/engine mismatch that would surface only after a long load (or as
zero acceptance), found from the files on disk in seconds.

Reads config files, tokenizer files and safetensors *headers* (plus the small ``d2t``/``t2d`` tensors). The
target is at most instantiated on the meta device with its decoder cut to a few layers (the layer path does not
depend on the depth), so a 1T-parameter Kimi-K2.5 config takes about as long as a tiny one.

Each finding has a stable id, a severity (``error``: fails at load or accepts ~nothing; ``warning``: likely
trouble; ``info``), the evidence (file and field) and the fix. Engine facts come from the installed engine when
there is one (vLLM's source, read with ``ast``), else from the per-version table in
``draftsmith.core.vllm_facts``.

``--target``/``--drafter`` also take a hub id (``ORG/NAME[@REVISION]``): read from the Hugging Face cache, or
online from the hub's metadata files and safetensors headers, never its weights. What was not checked (the
weights of a metadata-only download) is a note in the report, not a finding.

Modules: ``diagnosis`` (``diagnose``: setup, then the checks in order), ``hub`` (hub ids to a local snapshot),
``state`` (what the engine, target and drafter directories hold, read once), ``weights`` (the target's weight
files: whole, truncated, metadata-only, pickle-only or absent), ``target_checks``, ``engine_checks``,
``drafter_checks``, ``aux_checks``, ``report`` (findings and the report) and ``hfsource`` (transformers' source
read with ``ast``).
"""

from draftsmith.core.tensorfile import read_safetensors_header, read_small_tensor
from draftsmith.stages.doctor.diagnosis import diagnose
from draftsmith.stages.doctor.hfsource import HFSource
from draftsmith.stages.doctor.report import ENGINES, SEVERITIES, DoctorReport, DoctorUsageError, Finding

__all__ = ["DoctorReport", "DoctorUsageError", "ENGINES", "Finding", "HFSource", "SEVERITIES", "diagnose",
           "read_safetensors_header", "read_small_tensor"]
