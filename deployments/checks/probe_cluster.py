"""What `specdec probe` does through the service's Ray cluster: kill a worker mid-stream, wait for
its restart, read each Ray process's memory."""

from __future__ import annotations

import asyncio
import time

from ..workers.worker import ROLES, Role, worker_handle


class LocalCluster:
    """The probe's hold on the service's Ray cluster: kills a worker's rank 0 (Serve's health check
    then restarts the worker's replica), waits for the restarted replica, and reads the RSS of
    this machine's Ray processes (its workers' ranks named by role)."""

    def __init__(self, address: str, app_name: str):
        import ray

        if not ray.is_initialized():
            ray.init(address=address, namespace="specdec", log_to_driver=False)
        self.app_name = app_name
        self.killed: dict[str, str] = {}  # role: the address its killed replica served

    async def kill(self, role: Role) -> float:
        """Kill the worker's rank 0; returns when, on the probe's clock."""
        import ray

        handle = worker_handle(role, self.app_name)
        self.killed[role] = await handle.get_address.remote()
        ranks = await handle.rank_handles.remote()
        await asyncio.to_thread(ray.kill, ranks[0], no_restart=True)
        return time.perf_counter()

    async def back(self, role: Role) -> float:
        """When a new replica of the worker answered, on the probe's clock."""
        handle = worker_handle(role, self.app_name)
        while True:
            try:
                if await asyncio.wait_for(handle.get_address.remote(), 1.0) != self.killed[role]:
                    return time.perf_counter()
            except Exception:  # noqa: BLE001 - no replica ready yet (or the call timed out): ask again
                pass
            await asyncio.sleep(0.25)

    def memory(self) -> dict[str, float]:
        """RSS in MiB per Ray actor process on this machine, keyed by role or process title."""
        import psutil

        roles = {}
        for role in ROLES:
            try:
                pids = worker_handle(role, self.app_name).pids.remote().result(timeout_s=30)
            except Exception:  # noqa: BLE001 - a worker that is down is left out of the table
                continue
            roles.update({pid: f"{role} worker" + (f" rank {rank}" if rank else "") for rank, pid in enumerate(pids)})
        rss = {}
        for process in psutil.process_iter(["pid", "cmdline", "memory_info"]):
            title = (process.info["cmdline"] or [""])[0]
            if title.startswith("ray::") and not title.startswith("ray::IDLE"):
                name = roles.get(process.info["pid"], title.split()[0].split(".")[0])  # not the method it runs
                rss[f"{name} (pid {process.info['pid']})"] = process.info["memory_info"].rss / 2**20
        return rss
