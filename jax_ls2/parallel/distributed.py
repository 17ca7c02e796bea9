"""Starting JAX's multi-process runtime from the environment, or doing nothing in one process."""
from __future__ import annotations

import os

import jax

ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
CLUSTER_PROCESS_COUNTS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
"""Process-count variables of the schedulers whose other settings ``jax.distributed``
reads itself (Slurm, Open MPI)."""
CPU_COLLECTIVES = ("gloo", "mpi")

_OP = "initialize_distributed"


def _int_setting(value, name: str, minimum: int) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise ValueError(f"{_OP}: {name} must be an integer >= {minimum}, got {value!r}")
        value = int(value)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_OP}: {name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{_OP}: {name} must be an integer >= {minimum}, got {value}")
    return value


def _cluster_process_count() -> int | None:
    for var in CLUSTER_PROCESS_COUNTS:
        count = _int_setting(os.environ.get(var), var, 1)
        if count is not None:
            return count
    return None


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, cpu_collectives: str | None = None) -> bool:
    """Calls ``jax.distributed.initialize`` when several processes run; a no-op otherwise.

    Call it first, before anything touches a device (then ``jax.devices()`` lists the
    devices of every process, and `make_mesh` spans them all).

    Each setting comes from its argument, else from the environment:
    ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0's coordinator),
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (0-based). Without them, a Slurm or
    Open MPI job of more than one task (``SLURM_NTASKS``, ``OMPI_COMM_WORLD_SIZE``) is
    initialised through ``jax.distributed``'s own cluster detection.

    Args:
      coordinator_address: ``"host:port"``; overrides ``JAX_COORDINATOR_ADDRESS``.
      num_processes: overrides ``JAX_NUM_PROCESSES``.
      process_id: this process's index in ``[0, num_processes)``; overrides ``JAX_PROCESS_ID``.
      cpu_collectives: ``"gloo"`` or ``"mpi"``: the collectives implementation for CPU
        devices (``jax_cpu_collectives_implementation``), needed for computations that
        span processes' CPU devices. GPUs use NCCL whatever this says.

    Returns:
      True when the multi-process runtime is running (started here or before), False
      for a single process (no process count, or a count of 1), where nothing is done.

    Raises:
      ValueError: a count > 1 without the coordinator address or the process id (and no
        scheduler to read them from), an address or id without a count, a process id
        outside ``[0, num_processes)``, a non-integer setting, or an unknown
        ``cpu_collectives``.
    """
    if cpu_collectives is not None and cpu_collectives not in CPU_COLLECTIVES:
        raise ValueError(f"{_OP}: cpu_collectives must be one of {CPU_COLLECTIVES} or None, got {cpu_collectives!r}")
    if jax.distributed.is_initialized():
        return True
    address = coordinator_address or os.environ.get(ENV_COORDINATOR_ADDRESS) or None
    count = _int_setting(num_processes if num_processes is not None else os.environ.get(ENV_NUM_PROCESSES),
                         f"num_processes ({ENV_NUM_PROCESSES})", 1)
    index = _int_setting(process_id if process_id is not None else os.environ.get(ENV_PROCESS_ID),
                         f"process_id ({ENV_PROCESS_ID})", 0)
    if count is None and (address is not None or index is not None):
        raise ValueError(f"{_OP}: a coordinator address or process id is set but not the process count; "
                         f"set {ENV_NUM_PROCESSES} (or pass num_processes)")
    cluster_count = _cluster_process_count() if count is None else None
    if (count or cluster_count or 1) == 1:
        if index not in (None, 0):
            raise ValueError(f"{_OP}: process_id must be 0 in a single process, got {index}")
        return False
    if count is not None:
        if index is not None and index >= count:
            raise ValueError(f"{_OP}: process_id must be in [0, {count}), got {index}")
        missing = [name for name, value in ((ENV_COORDINATOR_ADDRESS, address), (ENV_PROCESS_ID, index))
                   if value is None]
        if missing and _cluster_process_count() is None:
            raise ValueError(f"{_OP}: {count} processes need {' and '.join(missing)} too "
                             f"(or the matching arguments)")
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(address, count, index)
    return True
