"""With tensor parallelism every rank moves its own shard of the KV heads, so a transfer is over only when
every rank is done with it. Each step that carries connector work, the ranks' reports are gathered on rank 0
(which alone answers the EngineCore) and combined: a load is reported once every rank has finished it,
failed if any rank failed it; a producer's transfer is sent once every rank has served its shard. Until
then rank 0 keeps the partial counts, so a rank that finishes a step later than another is waited for.
"""
from __future__ import annotations

from collections import Counter

import msgspec

from tokenloom.core.kv_connector import WorkerConnector
from tokenloom.core.kv_metadata import KVConnectorOutput, KVWorkerInfo
from tokenloom.distributed.parallel_state import gather_bytes_to_first, tp_group

_decoder = msgspec.msgpack.Decoder(KVConnectorOutput)


class RankReports:
    def __init__(self):
        self.size = tp_group().size
        self.loads: dict[str, list] = {}  # key -> [ranks done, first failure or None]
        self.sent: Counter[str] = Counter()

    def combine(self, report: KVConnectorOutput) -> KVConnectorOutput:
        """Call on every rank at the same step; rank 0 gets the combined report, the others an empty one."""
        if self.size == 1:
            return report
        parts = gather_bytes_to_first(msgspec.msgpack.encode(report))
        out = KVConnectorOutput()
        if parts is None:
            return out
        for part in map(_decoder.decode, parts):
            for key in part.loaded:
                self.loads.setdefault(key, [0, None])[0] += 1
            for key, why in part.failed.items():
                entry = self.loads.setdefault(key, [0, None])
                entry[0] += 1
                entry[1] = entry[1] or why
            self.sent.update(part.sent)
        for key, (ranks, why) in list(self.loads.items()):
            if ranks == self.size:
                del self.loads[key]
                if why:
                    out.failed[key] = why
                else:
                    out.loaded.append(key)
        for tid, ranks in list(self.sent.items()):
            if ranks == self.size:
                del self.sent[tid]
                out.sent.append(tid)
        return out


def group_info(connector: WorkerConnector) -> KVWorkerInfo:
    """The connector's start-up info on rank 0 with every rank's producer endpoint (rank r serves shard r).
    A collective: every rank calls it."""
    info = connector.info()
    addresses = gather_bytes_to_first(info.address.encode())
    if addresses is not None and info.address:
        info.addresses = [a.decode() for a in addresses]
    return info
