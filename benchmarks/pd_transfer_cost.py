"""What one PD pull costs over the transport alone (inferd/kv/connectors/pd/transport.py): a
2048-token prompt (128 blocks of 16) of the default model's pool layout (30 layers, K and V, 3 KV
heads x 64, fp32: 90 MiB) pulled between two pools in one process, over shared memory and TCP.
Run: PYTHONPATH=. python benchmarks/pd_transfer_cost.py"""

import statistics
import time

import torch

from inferd.kv.connectors.layout import KVBlockLayout
from inferd.kv.connectors.pd.transport import BlockIO, KVReceiver, KVSender, Outgoing
from inferd.kv.kv_cache import KVCache

# The default model's pool: 30 layers, K and V, block 16, 3 KV heads x 64, fp32.
L, P, BS, H, D, N = 30, 2, 16, 3, 64, 200
lay = KVBlockLayout("m", "float32", BS, 1, L, P, H, D, False)
src = KVCache(torch.randn(L, P, N, BS, H, D))
dst = KVCache(torch.zeros(L, P, N, BS, H, D))
s = KVSender(BlockIO(src), lay)
res = {}
for transport in ("shm", "tcp"):
    r = KVReceiver(BlockIO(dst), lay, 60, transport)
    times = []
    for i in range(7):
        tid = f"{transport}{i}"
        s.register(
            tid,
            Outgoing(
                list(range(2048)),
                2048,
                list(range(128)),
                {"output_token_ids": [1]},
                time.monotonic() + 60,
            ),
        )
        got = r.pull(
            {"transfer_id": tid, "endpoint": s.endpoint, "hostname": s.hostname},
            0,
            list(range(60, 188)),
        )
        times.append(got.seconds)
        r.release({"transfer_id": tid, "endpoint": s.endpoint})
    assert torch.equal(dst.data[:, :, 60:188], src.data[:, :, :128])
    med = statistics.median(times)
    res[transport] = med
    print(
        f"{transport}: 2048 tokens / 128 blocks ({128 * BlockIO(src).block_bytes() / 2**20:.1f} MiB): median {med * 1000:.1f} ms "
        f"= {med * 1e6 / 2048:.1f} us/token, {med * 1e6 / 128:.0f} us/block (min {min(times) * 1000:.1f} ms, 7 pulls)"
    )
    r.close()
s.close()
