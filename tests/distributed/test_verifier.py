"""`TargetVerifier`: decoding in a Ray actor apart from the HTTP replica (real local Ray, tiny models).

The verifier path must give the in-replica tokens, see documents ingested through the replica, and turn
its own death into a restart that greedy requests in flight survive whole (a clear 503 where that cannot be
done losslessly).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.test_draft_worker import tiny_model_folder


def test_verifier_flags_reach_the_config_and_imply_the_actor() -> None:
    import argparse

    from rasd.errors import CliError
    from rasd.serve.app import build_app
    from rasd.serve.config import ServeConfig
    from rasd.serve.options import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def config(*flags: str) -> ServeConfig:
        return ServeConfig.from_args(parser.parse_args(["serve", *flags]))

    assert config().verifier_actor is False and config().verifier_options == {}
    assert config("--verifier-actor").verifier_actor is True
    gpu = config("--verifier-gpus", "1", "--verifier-resources", '{"rasd_verifier": 1}')
    assert gpu.verifier_actor is True
    assert gpu.verifier_options == {"num_gpus": 1.0, "resources": {"rasd_verifier": 1}}
    with pytest.raises(CliError, match="JSON"):
        config("--verifier-resources", "{rasd_verifier")
    with pytest.raises(CliError, match="JSON object"):
        config("--verifier-resources", "[1]")
    with pytest.raises(CliError, match=">= 0"):
        config("--verifier-gpus", "-1")
    # the CPUs go to the process that decodes: the verifier actor, not the HTTP replica
    replicas = [build_app({"verifier_actor": actor, "threads": 2})._bound_deployment.init_args[0]._bound_deployment
                for actor in (True, False)]     # the app is the ingress bound to the model replicas
    cpus = [d.ray_actor_options["num_cpus"] for d in replicas]
    assert cpus == [0, 2]


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local Ray for this module; shut down afterwards if this fixture started it (later modules start
    their own)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from rasd.index.writer import build_index
    from tests.helpers import topic_documents

    base = tmp_path_factory.mktemp("verifier")
    folder = str(tiny_model_folder(base / "model")[0])
    root = base / "idx"
    build_index(topic_documents()[:2], root, model=folder, chunk_tokens=24, overlap=6)
    return folder, root


def request(prompt: str, max_tokens: int, method: str = "rasd") -> Any:
    from rasd.serve.openai import CompletionRequest

    return CompletionRequest(prompt=prompt, max_tokens=max_tokens, method=method, temperature=0.0)


def run(service: Any, req: Any) -> list[int]:
    ids = service.encode_text(req.prompt)
    return asyncio.run(service.run(service.prepare(req, ids, req.method, req.max_tokens))).token_ids


@pytest.mark.slow
def test_verifier_actor_gives_the_in_replica_tokens_and_sees_ingested_documents(
        ray_local: None, setup: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from rasd.serve.service import ServeConfig, Service
    from tests.helpers import TOPICS, topic_documents

    monkeypatch.setenv("RASD_HOME", str(tmp_path / "home"))
    folder, built = setup
    new_doc = topic_documents()[3]
    prompts = [request(TOPICS["rockets"][:90], 24), request(new_doc.text[:80], 24, "retrieval")]
    outs: dict[bool, list[list[int]]] = {}
    for actor in (False, True):
        root = tmp_path / f"idx-{actor}"
        shutil.copytree(built, root)
        service = Service(ServeConfig(model=folder, index=str(root), threads=1, verifier_actor=actor))
        try:
            assert type(service.backend).__name__ == ("RemoteBackend" if actor else "LocalBackend")
            outs[actor] = [run(service, prompts[0])]
            added = service.add_documents([{"text": new_doc.text, "title": new_doc.title}])
            assert added["added"] == 1
            outs[actor].append(run(service, prompts[1]))   # drafts from the document just added
            assert service.load() == (0, 0)
            info = service.info()
            assert (info["verifier"] or "").startswith("rasd-verifier-") == actor
        finally:
            service.close()
    assert outs[True] == outs[False]


@pytest.mark.slow
def test_a_dead_verifier_is_restarted_and_greedy_requests_survive_it(
        ray_local: None, setup: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kill the verifier with requests in flight: greedy ones are re-sent and come out whole and equal to
    the reference; an unseeded sampled one that had streamed tokens gets a clear 503; nothing hangs."""
    import ray

    from rasd.distributed.verifier import verifier_handle
    from rasd.serve.openai import ApiError, CompletionRequest
    from rasd.serve.service import ServeConfig, Service
    from tests.helpers import TOPICS

    monkeypatch.setenv("RASD_HOME", str(tmp_path / "home"))
    folder, root = setup
    service = Service(ServeConfig(model=folder, index=str(root), threads=1, verifier_actor=True, max_batch=1))
    greedy = request(TOPICS["rockets"][:60], 150, "ar")
    # EOS banned, so the sampled request is still streaming when the verifier dies (an unseeded sample once
    # ended after 6 tokens, before the kill, and came out whole instead of as a 503)
    no_eos = {str(t): -100.0 for t in service.target.eos_token_ids}
    sampled = CompletionRequest(prompt=greedy.prompt, max_tokens=150, method="ar", temperature=1.0,
                                logit_bias=no_eos)
    try:
        reference = run(service, greedy)
        handle = verifier_handle(service.backend.name)
        ids = service.encode_text(greedy.prompt)

        async def one(p: Any, first: asyncio.Event) -> tuple[str, list[int]]:
            tokens: list[int] = []
            try:
                async for kind, payload in service.events(p):
                    first.set()
                    if kind == "tokens":
                        tokens += payload
                    if kind == "done":
                        assert payload.token_ids == tokens, "streamed blocks must add up to the output"
                        return "done", tokens
            except ApiError as exc:
                first.set()
                return f"{exc.status}: {exc.message}", tokens
            return "ended without done", tokens

        async def drill() -> list[tuple[str, list[int]]]:
            reqs = [service.prepare(sampled, ids, "ar", 150)] + [service.prepare(greedy, ids, "ar", 150)] * 4
            firsts = [asyncio.Event() for _ in reqs]
            tasks = [asyncio.create_task(one(p, ev)) for p, ev in zip(reqs, firsts, strict=True)]
            await asyncio.wait_for(firsts[0].wait(), 60)      # the sampled request has streamed its first token
            ray.kill(handle, no_restart=False)
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 180))

        outcomes = asyncio.run(drill())
        assert outcomes[0][0].startswith("503: the verifier process stopped"), outcomes[0]
        assert outcomes[0][1], "the sampled request had streamed tokens before the kill"
        for status, tokens in outcomes[1:]:
            assert status == "done" and tokens == reference
        assert service.backend.stats()["requests_resent"] >= 4
        assert run(service, greedy) == reference
    finally:
        service.close()


class Replaying:
    """A `RemoteBackend` whose attempts are scripted: each a list of token blocks, then a death or the end."""

    @staticmethod
    def backend(attempts: list[tuple[list[Any], bool]]) -> Any:
        from ray.exceptions import RayActorError

        from rasd.distributed.backend import DecodingSettings
        from rasd.distributed.verifier import RemoteBackend

        class Scripted(RemoteBackend):
            async def _stream(self, prepared: Any, sourced: bool) -> Any:
                blocks, dies = attempts.pop(0)
                for block in blocks:
                    yield "tokens", block
                if dies:
                    raise RayActorError()
                yield "done", "output"

        return Scripted(DecodingSettings(), {})

    @staticmethod
    def run(backend: Any) -> tuple[list[Any], str]:
        """The blocks the caller received, and how the stream ended ("done" or the ApiError's status)."""
        from rasd.distributed.backend import Prepared
        from rasd.serve.openai import ApiError
        from rasd.serve.service import SamplingParams

        got: list[Any] = []

        async def consume() -> str:
            try:
                async for kind, payload in backend.events(Prepared([1, 2], "ar", 8, SamplingParams(), [])):
                    if kind == "done":
                        return "done"
                    got.append(payload)
            except ApiError as exc:
                return f"{exc.status}: {exc.message}"
            return "ended without done"

        return got, asyncio.run(consume())


@pytest.mark.parametrize("blocked", [False, True], ids=["ids", "TokenBlock"])
def test_a_replay_that_agrees_is_joined_and_one_that_differs_is_a_503_never_a_splice(blocked: bool) -> None:
    """After a verifier death the request is decoded again; the tokens the caller already has are compared,
    not just counted: a second attempt that differs before them (a near-tie broken the other way) would join two
    answers, so it ends the request with 503 after the sent part, never with the new attempt's continuation."""
    pytest.importorskip("ray")
    from rasd.distributed.backend import TokenBlock

    def b(*tokens: int) -> Any:
        return TokenBlock(list(tokens), ["bonus"] * len(tokens), None) if blocked else list(tokens)

    def ids(blocks: list[Any]) -> list[list[int]]:
        return [list(x.tokens) if blocked else x for x in blocks]

    agreeing = Replaying.backend([([b(1, 2), b(3)], True), ([b(1, 2, 3, 4), b(5)], False)])
    got, end = Replaying.run(agreeing)
    assert end == "done" and ids(got) == [[1, 2], [3], [4], [5]]
    assert agreeing.requests_resent == 1
    for second in ([b(1, 9, 3, 4), b(5)], [b(1), b(2, 7), b(8)]):
        differing = Replaying.backend([([b(1, 2), b(3)], True), (second, False)])
        got, end = Replaying.run(differing)
        assert end.startswith("503: the verifier restarted and decoded this request differently"), end
        assert ids(got) == [[1, 2], [3]], "nothing of the second attempt may follow the first's tokens"
