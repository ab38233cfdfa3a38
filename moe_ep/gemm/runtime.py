"""SMs the GEMMs may use (DeepGEMM's ``get_num_sms`` / ``set_num_sms``) and the grid size that cap gives a
launch (a persistent loop over the tiles when capped)."""

from __future__ import annotations

import os
from typing import Optional

import torch

CPU_DEFAULT_NUM_SMS = os.cpu_count() or 1
_num_sms = 0  # 0: the device's count (no cap)


def _device_num_sms() -> Optional[int]:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def get_num_sms() -> int:
    """SMs the GEMMs may use: the value set by :func:`set_num_sms`, else the current CUDA device's SM count
    (``os.cpu_count()`` without a CUDA device)."""
    if _num_sms:
        return _num_sms
    dev = _device_num_sms()
    return dev if dev is not None else CPU_DEFAULT_NUM_SMS


def set_num_sms(new_num_sms: int) -> None:
    """Let the GEMMs use at most ``new_num_sms`` SMs (their grid becomes persistent: at most that many
    programs, each looping over tiles). ``0`` restores the default (the device's count, no cap). Bounded by
    the current device's SM count, as in DeepGEMM."""
    global _num_sms
    if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms < 0:
        raise ValueError(f"num_sms must be a non-negative int, got {new_num_sms!r}")
    dev = _device_num_sms()
    if dev is not None and new_num_sms > dev:
        raise ValueError(f"num_sms={new_num_sms} exceeds the device's {dev} SMs")
    _num_sms = new_num_sms


def _grid_size(num_tiles: int) -> int:
    """Programs for ``num_tiles`` tiles: one each unless :func:`set_num_sms` capped the SMs."""
    return max(1, min(num_tiles, _num_sms)) if _num_sms else max(1, num_tiles)
