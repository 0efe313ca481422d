"""A trained policy behind openpi's websocket protocol, and held-out evaluation.

    runner = PolicyRunner.from_run_dir("runs/pi")      # the run's newest checkpoint
    out = runner.infer({"observation.images.top": img, ..., "observation.state": s, "prompt": "move ..."})
    out["actions"]                                    # [chunk, action_dim], unnormalized
    serve(runner, port=8000)                          # openpi clients connect to ws://host:8000

The wire format is openpi's (`openpi_client.msgpack_numpy`): msgpack, numpy arrays as maps
{"__ndarray__": true, "data": bytes, "dtype": str, "shape": [...]}. On connect the server sends
its metadata; then each observation message gets one action message back (with
`server_timing`), or a text frame holding the error and a close. `/healthz` answers OK.
Sampling is deterministic: each request starts from the same noise seed (`seed`).
"""

from __future__ import annotations

import asyncio
import functools
import http
import json
import time
from pathlib import Path

import msgpack
import numpy as np
import torch
from loongforge.core.errors import UserError
from loongforge.embodied.data.normalize import Normalizer
from loongforge.embodied.pi_task import PolicyInputs, observation
from loongforge.embodied.policies import PiPolicy


def pack_array(obj):
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in ("V", "O", "c"):
        raise ValueError(f"unsupported dtype: {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def unpack_array(obj):
    if b"__ndarray__" in obj:
        return np.ndarray(buffer=obj[b"data"], dtype=np.dtype(obj[b"dtype"]), shape=obj[b"shape"])
    if b"__npgeneric__" in obj:
        return np.dtype(obj[b"dtype"]).type(obj[b"data"])
    return obj


packb = functools.partial(msgpack.packb, default=pack_array)
unpackb = functools.partial(msgpack.unpackb, object_hook=unpack_array)


def read_run(run_dir: Path, ema: bool | None = None):
    """(the run config, the newest checkpoint's model state, LoRA adapters merged into their
    weights) of a finished or running run. `ema`:
    the EMA of the weights (`train.ema_decay`) or the trained weights; None: the EMA where the run
    kept one, as openpi serves."""
    from loongforge.core.checkpoint.dcp_io import read_run as read_torch_run
    from loongforge.core.foundation.lora import merge_adapters
    from loongforge.embodied.config import PiRunConfig

    cfg, state = read_torch_run(run_dir, PiRunConfig, "embodied.pi", ema, what="serve")
    return cfg, merge_adapters(state, cfg.lora.scale) if cfg.lora.enabled else state


class PolicyRunner:
    """One process's policy for inference: observations in (raw units), action chunks out."""

    def __init__(
        self,
        policy: PiPolicy,
        inputs: PolicyInputs,
        normalizer: Normalizer,
        state_key: str,
        action_key: str,
        action_dim: int,
        device,
        seed: int = 0,
        cuda_graphs: bool = True,
    ):
        self.policy, self.inputs, self.normalizer = policy.eval(), inputs, normalizer
        self.state_key, self.action_key, self.action_dim, self.device, self.seed = state_key, action_key, action_dim, device, seed
        # on CUDA each chunk replays one graph per observation shape (eager: `cuda_graphs=False`)
        self.sample = policy.graphed_sampler() if cuda_graphs else lambda obs, noise: policy.sample_actions(obs, noise=noise)

    @classmethod
    def from_run_dir(cls, run_dir, device: str = "cpu", seed: int = 0, ema: bool | None = None, cuda_graphs: bool = True) -> "PolicyRunner":
        from loongforge.core.data.text import load_tokenizer
        from loongforge.core.ops import OpTable
        from loongforge.core.registry import registry

        run_dir = Path(run_dir)
        cfg, state = read_run(run_dir, ema)
        # the kernels training ran with (the run's `ops` choices, each op's fastest for the device)
        policy = PiPolicy(cfg.policy, OpTable.build(cfg.ops, registry(), torch.device(device).type))
        policy.load_state_dict(state, strict=True)
        stats = json.loads((run_dir / "normalizer.json").read_text())
        first = next(iter(stats.values()))  # the first dataset's normalization
        normalizer = Normalizer.from_state_dict(first)
        tok_dir = run_dir / "tokenizer"
        tok = load_tokenizer(str(tok_dir) if tok_dir.is_dir() else cfg.data.tokenizer)
        meta = json.loads((run_dir / "policy_io.json").read_text())
        inputs = PolicyInputs(cfg.policy, meta["cameras"], tok, cfg.data.max_prompt_tokens)
        return cls(
            policy.to(device), inputs, normalizer, cfg.data.state_key, cfg.data.action_key, meta["action_dim"], device, seed, cuda_graphs
        )

    def metadata(self) -> dict:
        return {
            "cameras": self.inputs.cameras,
            "state_key": self.state_key,
            "chunk_size": self.policy.cfg.chunk_size,
            "action_dim": self.action_dim,
        }

    @torch.no_grad()
    def infer(self, obs: dict) -> dict:
        if self.state_key not in obs:
            raise UserError(f"observation lacks {self.state_key!r} (it has: {', '.join(map(str, obs))})")
        prompt = obs.get("prompt", obs.get("task", ""))
        state = self.normalizer.normalize({self.state_key: np.asarray(obs[self.state_key], np.float32)})[self.state_key]
        batch = self.inputs.collate(
            [self.inputs.prepare({c: obs[c] for c in self.inputs.cameras if c in obs}, state, str(prompt))], self.device
        )
        g = torch.Generator(device=self.device).manual_seed(self.seed)
        cfg = self.policy.cfg
        noise = torch.randn(1, cfg.chunk_size, cfg.max_action_dim, generator=g, device=self.device)
        chunk = self.sample(observation(batch), noise)[0, :, : self.action_dim].float().cpu().numpy()
        return {"actions": self.normalizer.unnormalize({self.action_key: chunk})[self.action_key]}


async def _handle(runner: PolicyRunner, websocket) -> None:
    import websockets

    await websocket.send(packb(runner.metadata()))
    while True:
        try:
            obs = unpackb(await websocket.recv())
            t0 = time.monotonic()
            out = runner.infer(obs)
            out["server_timing"] = {"infer_ms": 1e3 * (time.monotonic() - t0)}
            await websocket.send(packb(out))
        except websockets.ConnectionClosed:
            return
        except Exception as e:  # the client gets the error as a text frame, then the close
            await websocket.send(f"{type(e).__name__}: {e}")
            await websocket.close(code=1011, reason="inference failed; the previous frame holds the error")
            return


def _health(connection, request):
    if request.path == "/healthz":
        return connection.respond(http.HTTPStatus.OK, "OK\n")
    return None


async def serve_async(runner: PolicyRunner, host: str = "0.0.0.0", port: int = 8000, ready=None) -> None:
    import websockets.asyncio.server as server

    async with server.serve(functools.partial(_handle, runner), host, port, compression=None, max_size=None, process_request=_health) as s:
        if ready is not None:
            ready(s)
        await s.serve_forever()


def serve(runner: PolicyRunner, host: str = "0.0.0.0", port: int = 8000) -> None:
    print(f"serving on ws://{host}:{port} (cameras {', '.join(runner.inputs.cameras)}); Ctrl-C stops", flush=True)
    try:
        asyncio.run(serve_async(runner, host, port))
    except KeyboardInterrupt:
        pass


def evaluate(runner: PolicyRunner, dataset, episodes: list[int], every: int = 1) -> dict:
    """Action MSE of sampled chunks against the recorded ones on `episodes` of `dataset` (every
    `every`-th frame): in the normalized space the policy trains in and in raw units."""
    chunk = runner.policy.cfg.chunk_size
    deltas = {runner.action_key: [k / dataset.fps for k in range(chunk)]}
    raw, normed, n = 0.0, 0.0, 0
    for e in episodes:
        ep = dataset.episode(e)
        for frame in range(ep.start, ep.stop, every):
            item = dataset.get(frame, [runner.state_key, *runner.inputs.cameras, "task"])
            obs = {
                **{c: item[c] for c in runner.inputs.cameras},
                runner.state_key: item[runner.state_key],
                "prompt": item.get("task") or "",
            }
            want = np.asarray(dataset.window(frame, deltas)[runner.action_key], np.float32).reshape(chunk, -1)
            got = runner.infer(obs)["actions"]
            norm = runner.normalizer.normalize
            raw += float(((got - want) ** 2).mean())
            normed += float(
                ((norm({runner.action_key: got})[runner.action_key] - norm({runner.action_key: want})[runner.action_key]) ** 2).mean()
            )
            n += 1
    if n == 0:
        raise UserError("no frames to evaluate: name episodes that exist and hold frames")
    return {"frames": n, "action_mse": raw / n, "action_mse_normalized": normed / n}
