"""AOTInductor packages of the step graph (llmd.export.aot) as a CompiledStep: the decode package
for up to ``small_m`` new tokens, the prefill package beyond."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import EngineDirError
from .base import CompiledStep


class AotBackend(CompiledStep):
    name = "aot"

    def __init__(self, decode_file: Path, prefill_file: Path, small_m: int):
        try:
            self.decode = torch._inductor.aoti_load_package(str(decode_file))
            self.prefill = torch._inductor.aoti_load_package(str(prefill_file))
        except Exception as e:       # compiled for another torch or CPU: the caller falls back to eager
            raise EngineDirError(f"{decode_file.parent}: cannot load the AOT packages ({e}); re-export") from None
        self.small_m = small_m

    @classmethod
    def from_engine_dir(cls, engine_dir: Path, manifest: dict, device: str = "auto") -> "AotBackend":
        # AOT packages are compiled for the CPU; loading checks the device before this
        aot = manifest.get("artifacts", {}).get("aot")
        if not aot:
            raise EngineDirError(f"{engine_dir}: the manifest names no AOT package; export with --aot")
        return cls(engine_dir / aot["decode"], engine_dir / aot["prefill"], aot["small_m"])

    @torch.inference_mode()
    def forward(self, input_ids, positions, past_k, past_v):
        run = self.decode if input_ids.shape[0] <= self.small_m else self.prefill
        logits, k, v = run(input_ids, positions, past_k, past_v)
        return logits.float(), k.float(), v.float()
