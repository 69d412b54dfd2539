"""The asyncio client does what the blocking one does."""

import asyncio

import numpy as np
import pytest

from tierd.client import AsyncClient, IdentityMismatch, InvalidArgument, KVSpec, NotFound, SharedKVCache

SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)


def test_async_client_round_trip(daemon):
    async def main():
        async with AsyncClient(daemon.socket) as c:
            data = np.random.default_rng(1).integers(0, 256, 1_500_000, dtype=np.uint8)
            info = await c.put("a", data, KVSpec.opaque("m"), num_tokens=9, chunk_bytes=200_000)
            assert info.size_bytes == data.nbytes
            assert await c.get("a") == data.tobytes()
            with SharedKVCache(SPEC, 16) as kv:
                kv.regions[0][:] = 7
                engine = await c.register_engine(SPEC, kv)
                await engine.save("kv", [1, 2], 20)
                kv.regions[0][:] = 0
                result = await engine.restore("kv", [5, 6])
                assert result.num_tokens == 20 and (kv.block(0, 5) == 7).all()
                other = KVSpec("test/other", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
                               block_tokens=16)
                async with await c.register_engine(other, kv) as wrong:
                    with pytest.raises(IdentityMismatch):
                        await wrong.restore("kv", [5, 6])
                await engine.close()
            await c.release("kv")
            assert (await c.prefetch("kv")) == "ready"
            assert [s.session_id for s in await c.list()] == ["a", "kv"]
            stats = await c.stats()
            assert {t.name for t in stats["tiers"]} == {"host", "disk"}
            await c.drop("a")
            with pytest.raises(NotFound):
                await c.stat("a")
            # many calls in flight at once on one channel
            infos = await asyncio.gather(*[c.stat("kv") for _ in range(50)])
            assert {i.num_tokens for i in infos} == {20}

    asyncio.run(main())


def test_async_client_refuses_bad_values_as_invalid_argument(daemon):
    """Regression: a Put whose header protobuf refused failed with a bare
    TierdError in the blocking client and a CancelledError here."""
    async def main():
        async with AsyncClient(daemon.socket) as c:
            with pytest.raises(InvalidArgument, match="num_tokens cannot be -1"):
                await c.put("a", b"x", KVSpec.opaque("m"), num_tokens=-1)
            with pytest.raises(InvalidArgument, match="priority"):
                await c.put("a", b"x", KVSpec.opaque("m"), num_tokens=1, priority=2**40)
            with pytest.raises(InvalidArgument, match="session_id"):
                await c.stat(7)
            with pytest.raises(InvalidArgument, match="chunk_bytes"):
                await c.get("a", chunk_bytes=-1)
            assert await c.list() == []

    asyncio.run(main())
