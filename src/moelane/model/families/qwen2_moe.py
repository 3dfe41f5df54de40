"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA with q/k/v bias and no q/k norm; a softmax top-k router whose
weights are rounded to the model's dtype, optionally renormalised (`norm_topk_prob`, off in the released
checkpoints); one shared expert per MoE layer (`mlp.shared_expert`) whose output is scaled by a sigmoid gate
(`mlp.shared_expert_gate`); dense layers where `mlp_only_layers` / `decoder_sparse_step` say so. Sliding-window
layers follow `layer_types`, where `use_sliding_window` is set."""

from __future__ import annotations

from dataclasses import dataclass

from moelane.model.attention import Attention
from moelane.model.config import WINDOW, Config, key
from moelane.model.decoder import Decoder, sliding_windows, sparse_layers
from moelane.model.family import Family
from moelane.model.layers import MLP
from moelane.model.moe import MoeBlock, Names
from moelane.model.routers import SoftmaxTopK


@dataclass(frozen=True, slots=True, kw_only=True)
class Qwen2MoeConfig(Config):
    max_position_embeddings: int = key(default=32768, low=1)
    n_experts: int = key("num_experts", "num_local_experts", default=0, low=0)
    top_k: int | None = key("num_experts_per_tok", default=None)
    expert_width: int | None = key("moe_intermediate_size", default=None, low=1)
    shared_expert_intermediate_size: int | None = key(default=None, low=1)
    norm_topk_prob: bool = False
    qkv_bias: bool = True  # (transformers' default; released configs leave it out)
    mlp_only_layers: list[int] | None = None
    decoder_sparse_step: int = key(default=1, low=1)
    use_sliding_window: bool = False
    sliding_window: int | None = key(default=None, what=WINDOW)
    layer_types: list[str] | None = None

    def check(self) -> None:
        if self.moe_layers() and self.shared_expert_intermediate_size is None:
            raise self.missing("shared_expert_intermediate_size")
        self.windows()

    def moe_layers(self) -> list[int]:
        if self.n_experts == 0:
            return []
        return sparse_layers(self.num_hidden_layers, self.decoder_sparse_step, self.mlp_only_layers)

    def windows(self) -> list[int | None]:
        window = self.sliding_window if self.use_sliding_window else None
        return sliding_windows(self.num_hidden_layers, window, self.layer_types, by_layer_types=True)


class Qwen2Moe(Family[Qwen2MoeConfig]):
    config_class = Qwen2MoeConfig

    def build(self, config: Qwen2MoeConfig) -> Decoder:
        windows, hidden = config.windows(), config.hidden_size
        names = Names(shared="shared_expert", shared_gate="shared_expert_gate")

        def moe() -> MoeBlock:
            assert config.shared_expert_intermediate_size is not None
            router = SoftmaxTopK(config.k, config.norm_topk_prob, round_weights=True)
            shared = MLP(hidden, config.shared_expert_intermediate_size)
            return MoeBlock(hidden, config.n_experts, router, names=names, shared=shared)

        return Decoder(config, lambda i: Attention.of(config, bias=config.qkv_bias, window=windows[i]), config.rope(),
                       moe=moe)  # fmt: skip


FAMILY = Qwen2Moe()
