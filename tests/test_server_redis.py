"""Servers sharing one snapshot tier on a real redis-server, over real HTTP on 127.0.0.1 with the real
default model on the CPU: a conversation's next turn on another server restores from Redis, and a
Redis killed under a server costs answers nothing."""

from __future__ import annotations

import time
import warnings

from kvflash.storage import SnapshotStore
from kvflash.storage.redis_link import RedisConfig
from kvflash.storage.redis_store import RedisStore
from kvflash.storage.tiered import TieredStore
from tests.redis_util import RedisServer
from tests.test_server import DOC, TURN1, ask, serving
from tests.test_server import lm as lm  # noqa: F401 (the module's model fixture)


def test_a_conversation_continues_on_another_server_from_redis(lm, redis_server, tmp_path) -> None:  # noqa: F811
    with TieredStore(SnapshotStore(tmp_path / "a"), RedisStore(redis_server.url)) as a:
        with serving(lm, a) as (url, _):
            first = ask(url, TURN1)
    turn2 = [*TURN1, {"role": "assistant", "content": first.choices[0].message.content}]
    turn2.append({"role": "user", "content": "And the bakery?"})
    with TieredStore(SnapshotStore(tmp_path / "b"), RedisStore(redis_server.url)) as b:
        with serving(lm, b) as (url, _):
            restored = ask(url, turn2)
    assert restored.model_extra["kvflash"]["source"] in ("disk", "lazy")
    assert restored.usage.prompt_tokens_details.cached_tokens >= 64
    with serving(lm, None) as (url, _):
        cold = ask(url, turn2)
    assert restored.choices[0].message.content == cold.choices[0].message.content


def test_redis_killed_under_a_server_costs_no_answer_and_leaves_no_half_snapshot(lm, tmp_path) -> None:  # noqa: F811
    redis = RedisServer(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always").start()
    other = [{"role": "system", "content": DOC.replace("Elden", "Arlow")}, TURN1[1]]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            st = RedisStore(RedisConfig(redis.url, retry_s=0.2))
            with serving(lm, st) as (url, _):
                assert ask(url, TURN1).choices[0].message.content
                redis.kill()  # while the answer's snapshot is being written, or just after
                t0 = time.monotonic()
                down = ask(url, other)  # its lookup and its save both meet a dead Redis
                assert down.choices[0].message.content
                assert down.usage.prompt_tokens_details.cached_tokens == 0
                assert time.monotonic() - t0 < 60
                redis.start()
                time.sleep(0.3)
                again = ask(url, TURN1)
                assert again.choices[0].message.content == ask(url, TURN1).choices[0].message.content
            st.close()
        with RedisStore(redis.url) as check:
            report = check.verify()
            assert report.ok, report
            for s in check.list_snapshots():
                assert (
                    check.find_longest_prefix(s.fingerprint, list(check.get_snapshot(s.id).chunk_hashes))
                    == s.n_chunks
                )
    finally:
        redis.stop()
