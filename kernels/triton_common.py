"""What the Triton sources share: grid dependency control (PDL) and whether a launch asks for it.

Imports Triton: only the Triton launchers import this module, on the first GPU call.
"""
from __future__ import annotations

import os

from .device import DeviceCaps

try:  # Triton >= 3.3 exposes grid dependency control (PDL)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - old Triton: PDL is never requested then
    gdc_launch_dependents = gdc_wait = None


def pdl_default(caps: DeviceCaps) -> bool:
    """Programmatic dependent launch where the GPU supports it (NVIDIA sm90+) and Triton exposes it;
    REDLINE_PDL=0 turns it off for comparisons."""
    if os.environ.get("REDLINE_PDL", "1") == "0" or gdc_wait is None:
        return False
    return caps.supports_pdl
