"""What `specdec probe` does through the service's Ray cluster: kill a worker's rank mid-stream,
lose the simulated node that holds one (`specdec serve --simulate-nodes`), wait for the worker's
new replica, count what the workers hold, read each Ray process's memory and a worker's stats.

It finds the workers in the GCS's actor table (a replica of the worker's deployment, and the
ranks that replica owns), not by calling them: on a cluster of simulated nodes a driver other
than the one that started it does not get Serve's replies (the replica logs the call answered,
the caller times out resolving it), so a handle call there would hang the probe."""

from __future__ import annotations

import asyncio
import time

from ..workers.worker import ROLES, Role, deployment_name, worker_handle

HANDLE_TIMEOUT_S = 30.0  # a call through a worker's deployment handle, answered or given up


class NodeNotLosable(Exception):
    """Why the probe cannot lose a worker's node: the head node's (the server and the proxy run
    there), or not a simulated node of this machine (a real node is not the probe's to remove)."""


def at(address: dict) -> tuple:
    """An actor table's address (of an actor, or of its owner) as (ip, port)."""
    return address["IPAddress"], address["Port"]


def held_by_workers() -> tuple[int, int]:
    """What a fault may leak: the worker ranks alive, and the placement groups in place."""
    import ray

    actors = ray._private.state.actors().values()  # from the GCS: no dashboard needed
    ranks = sum(1 for actor in actors if actor["ActorClassName"].endswith("WorkerRank") and actor["State"] == "ALIVE")
    groups = ray.util.placement_group_table().values()
    return ranks, sum(1 for group in groups if group["state"] == "CREATED")


class LocalCluster:
    """The probe's hold on the service's Ray cluster (`app_name`'s workers)."""

    def __init__(self, address: str, app_name: str):
        import ray

        if not ray.is_initialized():
            ray.init(address=address, namespace="specdec", log_to_driver=False)
        self.app_name = app_name
        self.faulted: dict[str, str] = {}  # role: the replica whose rank was killed or whose node was lost

    def worker(self, role: Role) -> tuple[str, list[dict]]:
        """The worker's replica (its actor's name) and the ranks it owns, rank 0 first, as the
        GCS's actor table lists them."""
        import ray

        actors = [actor for actor in ray._private.state.actors().values() if actor["State"] == "ALIVE"]
        replica_class = f"ServeReplica:{self.app_name}:{deployment_name(role)}"
        ranks = [actor for actor in actors if actor["ActorClassName"].endswith("WorkerRank")]
        for replica in sorted(actors, key=lambda actor: actor["StartTime"]):
            owned = [rank for rank in ranks if at(rank["OwnerAddress"]) == at(replica["Address"])]
            if replica["ActorClassName"] == replica_class and owned:  # ranks named "...rank N" (worker.py)
                return replica["Name"], sorted(owned, key=lambda rank: int(rank["Name"].rpartition("rank ")[2]))
        raise LookupError(f"no replica of the {role} worker has ranks alive")

    async def kill(self, role: Role) -> float:
        """Kill the worker's rank 0 (Serve's health check then restarts its replica): its process
        where it runs on this machine, else through its replica's handle as `ray.kill`; returns
        when, on the probe's clock."""
        import psutil
        import ray

        self.faulted[role], ranks = await asyncio.to_thread(self.worker, role)
        if node_processes(ranks[0]["Address"]["NodeID"]):  # its node runs here: so does its process
            psutil.Process(ranks[0]["Pid"]).kill()
        else:
            handle = worker_handle(role, self.app_name).rank_handles.remote()
            rank = (await asyncio.wait_for(handle, HANDLE_TIMEOUT_S))[0]
            await asyncio.to_thread(ray.kill, rank, no_restart=True)
        return time.perf_counter()

    async def node_of(self, role: Role) -> str:
        """The id of the simulated node that holds the worker's rank 0, one the probe may lose."""
        import ray

        node_id = (await asyncio.to_thread(self.worker, role))[1][0]["Address"]["NodeID"]
        node = next((node for node in ray.nodes() if node["NodeID"] == node_id), None)
        if node is None or not node["Alive"]:
            raise NodeNotLosable("its node is already gone")
        if "node:__internal_head__" in node["Resources"]:
            raise NodeNotLosable("it runs on the head node, with the server")
        if not node_processes(node_id):
            raise NodeNotLosable("its node is not a simulated node of this machine (specdec serve --simulate-nodes)")
        return node_id

    async def lose_node(self, role: Role, node_id: str) -> float:
        """Kill the processes of the node that holds the worker, its workers too, as a machine
        lost takes them; returns when, on the probe's clock."""
        import psutil

        self.faulted[role] = (await asyncio.to_thread(self.worker, role))[0]
        for process in node_processes(node_id):
            try:
                process.kill()
            except psutil.NoSuchProcess:  # a worker that exited meanwhile
                pass
        return time.perf_counter()

    async def back(self, role: Role) -> float:
        """When another replica of the worker had its ranks alive, on the probe's clock."""
        while True:
            try:
                if (await asyncio.to_thread(self.worker, role))[0] != self.faulted[role]:
                    return time.perf_counter()
            except LookupError:  # none yet
                pass
            await asyncio.sleep(0.25)

    async def held(self) -> tuple[int, int]:
        return await asyncio.to_thread(held_by_workers)

    async def stats(self, role: Role) -> dict:
        """The worker's counts, its rank 0's (WorkerStats' fields)."""
        return await asyncio.wait_for(worker_handle(role, self.app_name).stats.remote(), HANDLE_TIMEOUT_S)

    def memory(self) -> dict[str, float]:
        """RSS in MiB per Ray actor process on this machine, keyed by role or process title."""
        import psutil

        roles = {}
        for role in ROLES:
            try:
                ranks = self.worker(role)[1]
            except LookupError:  # a worker that is down is left out of the table
                continue
            roles.update(
                {
                    rank["Pid"]: f"{role} worker" + (f" rank {index}" if index else "")
                    for index, rank in enumerate(ranks)
                }
            )
        rss = {}
        for process in psutil.process_iter(["pid", "cmdline", "memory_info"]):
            title = (process.info["cmdline"] or [""])[0]
            if title.startswith("ray::") and not title.startswith("ray::IDLE"):
                name = roles.get(process.info["pid"], title.split()[0].split(".")[0])  # not the method it runs
                rss[f"{name} (pid {process.info['pid']})"] = process.info["memory_info"].rss / 2**20
        return rss


def node_processes(node_id: str) -> list:
    """This machine's processes of a Ray node: its raylet and its agents, named by its id, and
    the workers the raylet started (a lost machine takes them along; killed with the raylet
    alone, they go on serving for a while)."""
    import psutil

    flags = (f"--node_id={node_id}", f"--node-id={node_id}")
    named = [
        process
        for process in psutil.process_iter(["cmdline"])
        if any(flag in (process.info["cmdline"] or ()) for flag in flags)
    ]
    workers = []
    for process in named:
        try:
            workers += process.children(recursive=True)
        except psutil.NoSuchProcess:  # gone meanwhile
            pass
    return named + workers
