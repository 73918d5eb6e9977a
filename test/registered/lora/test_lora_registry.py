"""LoRARegistry: name resolution, in-flight counting, and unload waiting for in-flight requests."""

import asyncio

import pytest

from sglang.srt.lora.lora_registry import LoRARegistry, make_dynamic_lora_ref, make_lora_ref
from sglang.srt.server_args import LoRAPathSpec


def run(coro):
    return asyncio.run(coro)


def test_startup_ids_are_deterministic_and_dynamic_ids_unique():
    a1 = make_lora_ref("sql=/adapters/sql")
    a2 = make_lora_ref(LoRAPathSpec("sql", "/adapters/sql"))
    assert a1.lora_id == a2.lora_id and a1.lora_name == "sql" and a1.lora_path == "/adapters/sql"
    assert make_lora_ref("sql=/adapters/other").lora_id != a1.lora_id
    assert make_lora_ref('{"lora_name": "p", "lora_path": "/x", "pinned": true}').pinned
    d1, d2 = make_dynamic_lora_ref("sql", "/adapters/sql"), make_dynamic_lora_ref("sql", "/adapters/sql")
    assert d1.lora_id != d2.lora_id != a1.lora_id


def test_acquire_resolves_names_and_counts():
    async def main():
        reg = LoRARegistry(["sql=/a/sql", "chat=/a/chat"])
        sql_id = reg.get("sql").lora_id
        assert await reg.acquire(None) is None
        ids = await reg.acquire(["sql", None, "sql", "chat"])
        assert ids[0] == ids[2] == sql_id and ids[1] is None
        assert reg.num_in_flight(sql_id) == 2 and reg.num_in_flight() == 3
        with pytest.raises(ValueError) as e:
            await reg.acquire(["sql", "nope"])
        assert "nope" in str(e.value) and "chat" in str(e.value) and "sql" in str(e.value)
        assert reg.num_in_flight() == 3  # a failed acquire takes nothing
        await reg.release(ids)
        assert reg.num_in_flight() == 0
        with pytest.raises(AssertionError):
            await reg.release(sql_id)
        assert set(reg.get_all()) == {"sql", "chat"}

    run(main())


def test_register_rejects_duplicates():
    async def main():
        reg = LoRARegistry()
        await reg.register(make_dynamic_lora_ref("a", "/a"))
        with pytest.raises(ValueError, match="already loaded"):
            await reg.register(make_dynamic_lora_ref("a", "/b"))
        with pytest.raises(ValueError, match="not loaded"):
            await reg.unregister("b")

    run(main())


def test_unregister_waits_for_in_flight_requests():
    async def main():
        reg = LoRARegistry(["a=/a", "b=/b"])
        a_id = await reg.acquire("a")
        a_id2 = await reg.acquire("a")
        b_id = await reg.acquire("b")
        task = asyncio.create_task(reg.unregister("a"))
        await asyncio.sleep(0.01)
        assert not task.done()
        # Gone for new requests at once, while the old ones still run.
        with pytest.raises(ValueError, match="not loaded"):
            await reg.acquire("a")
        await reg.release(b_id)  # another adapter's release does not wake it
        await reg.release(a_id)
        await asyncio.sleep(0.01)
        assert not task.done()
        await reg.release(a_id2)
        ref = await asyncio.wait_for(task, timeout=1.0)
        assert ref.lora_name == "a" and ref.lora_id == a_id
        assert set(reg.get_all()) == {"b"} and reg.num_in_flight() == 0
        # An idle adapter unregisters at once; a name can be registered again with a new id.
        assert (await asyncio.wait_for(reg.unregister("b"), 1.0)).lora_name == "b"
        await reg.register(make_dynamic_lora_ref("a", "/a"))
        assert (await reg.acquire("a")) != a_id

    run(main())


def test_many_concurrent_requests_balance():
    async def main():
        reg = LoRARegistry(["a=/a", "b=/b"])

        async def request(name):
            lid = await reg.acquire(name)
            await asyncio.sleep(0.001)
            await reg.release(lid)

        await asyncio.gather(*(request(["a", "b", None][i % 3]) for i in range(300)))
        assert reg.num_in_flight() == 0

    run(main())
