"""Device names from flags, checked before anything is loaded onto them."""

from __future__ import annotations


def check_device(device: str, flag: str = "--device") -> None:
    """Refuse a device this torch build or machine cannot use, naming the flag (torch
    itself fails later, deep in a load, with an AssertionError)."""
    import torch

    try:
        place = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{flag} {device!r} is not a device name (cpu, cuda, cuda:0)") from err
    if place.type == "cpu":
        return
    if place.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{flag} {device}: this torch build or machine has no CUDA GPU; "
                "leave out the flag to run on the CPU"
            )
        if place.index is not None and place.index >= torch.cuda.device_count():
            raise ValueError(
                f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)"
            )
        return
    backend = getattr(torch, place.type, None)
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise ValueError(f"{flag} {device}: torch cannot use {place.type} devices here")
