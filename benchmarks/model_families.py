"""Transformers families the tests do not cover, through the whole path: profile, a planner-made 2-stage plan, training.

    python benchmarks/model_families.py [--families bart,opt] [--steps 3] [--schedule 1f1b] [--keep DIR]
                                        [--device cuda] [--checkpointing non-reentrant]

Each family is built from a small config (no weights downloaded; dropout probabilities 0, so the
pipeline and plain PyTorch draw no masks) inside a model file written to a temporary folder, the
way a user writes one: a wrapper that takes tensors and returns the logits (`use_cache=False`).
The profiler finds its layers; `partition` plans it on 2 devices (straight, 4 microbatches); the
in-process runtime (`runtime.Pipeline.from_plan`: torch.fx where it traces, else torch.export) trains `--steps` SGD
steps on a batch of 8, and plain single-process PyTorch trains a copy on the same batches. Printed
per family: the layers found, the plan's stages, the split's method and seconds, and the largest
parameter difference after training next to how far training moved the parameters (fp32; "matches"
means torch.allclose at rtol 1e-5, atol 1e-6).
A family that fails says where, in one line, and the others go on. `--device cuda`: the profile is
still taken on the CPU, both stages and the plain model train on the GPU (TF32 off, so fp32 is compared).
`--checkpointing reentrant|non-reentrant`: each model file turns on transformers' gradient checkpointing
(`activation_checkpointing_enable`, `gradient_checkpointing_enable` before 5.x), as a user short of memory
does; the note then gives how many calls the stages keep checkpointed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.files.cluster import make_cluster  # noqa: E402
from planner.files.plan import Plan  # noqa: E402
from planner.planning.partition import partition  # noqa: E402
from planner.profiling.model_file import ModelFile, default_loss, load_model_file  # noqa: E402
from planner.profiling.profiler import ProfileSettings, profile_model  # noqa: E402
from runtime.kept_modules import KeptModule  # noqa: E402
from runtime.pipeline import Pipeline  # noqa: E402

BATCH = 8
MICROBATCHES = 4
LR = 0.1

# token models: (batch, 12) ids of a 128-word vocabulary; image models: (batch, 3, 32, 32); audio models:
# (batch, 8, 32) log-mel features and (batch, 12) decoder ids; masked models: the ids and an attention mask that
# hides each sequence's last three positions; waveform models: (batch, 400) samples, one label each
TOKENS = '''
VOCAB, CONTEXT = 128, 12


def example_batch(batch_size):
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], {target}
'''
MASKED = '''
VOCAB, CONTEXT = 128, 12


def example_batch(batch_size):
    mask = torch.ones(batch_size, CONTEXT, dtype=torch.long)
    mask[:, -3:] = 0
    return (torch.randint(0, VOCAB, (batch_size, CONTEXT)), mask), torch.randint(0, 4, (batch_size,))
'''
IMAGES = '''
def example_batch(batch_size):
    return torch.randn(batch_size, 3, 32, 32), torch.randint(0, 4, (batch_size,))
'''
AUDIO = '''
VOCAB, CONTEXT, MELS, FRAMES = 128, 12, 8, 32


def example_batch(batch_size):
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return (torch.randn(batch_size, MELS, FRAMES), tokens[:, :-1]), tokens[:, 1:]
'''
WAVEFORM = '''
SAMPLES = 400


def example_batch(batch_size):
    return torch.randn(batch_size, SAMPLES), torch.randint(0, 4, (batch_size,))
'''
CHECKPOINTING = '''
options = {{"use_reentrant": {reentrant}}}
if not model.model.supports_gradient_checkpointing:
    pass
elif hasattr(model.model, "activation_checkpointing_enable"):  # transformers 5.x
    model.model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
else:
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
'''
CAUSAL_LOSS = '''

def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
'''
MODEL = '''"""{family} from a small config, returning logits (a model file written by benchmarks/model_families.py)."""

import torch
import torch.nn.functional as F
from torch import nn
import transformers


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        config = transformers.{config}(**{settings!r})
        self.model = transformers.{model}(config)

    def forward(self, {parameters}):
        return self.model({call}).logits


def build_model():
    model = Wrapped()
{after_build}    return model
'''


@dataclass(frozen=True)
class Family:
    """One transformers family: its config and model classes, small settings, and what it reads."""

    name: str
    config: str
    model: str
    settings: dict
    kind: str  # "causal" (next-token logits), "seq2seq" (the same, the tokens also fed to the decoder),
    #            "classify" (one label per sequence), "masked-classify" (the same with an attention mask),
    #            "image" (one label per image), "audio" (features to the encoder, tokens to the decoder) or
    #            "waveform" (raw samples, one label per clip)
    after_build: str = ""  # statements run on `model` after it is built (a user's own initialisation)

    def model_file_text(self) -> str:
        """The model file a user would write for it."""
        parameters, call = {
            "causal": ("inputs", "input_ids=inputs, use_cache=False"), "classify": ("inputs", "input_ids=inputs"),
            "masked-classify": ("inputs, mask", "input_ids=inputs, attention_mask=mask"),
            "image": ("inputs", "pixel_values=inputs"),
            "seq2seq": ("inputs", "input_ids=inputs, decoder_input_ids=inputs, use_cache=False"),
            "audio": ("features, tokens", "input_features=features, decoder_input_ids=tokens, use_cache=False"),
            "waveform": ("inputs", "input_values=inputs"),
        }[self.kind]
        after_build = "".join(f"    {line}\n" for line in self.after_build.splitlines())
        text = MODEL.format(family=self.name, config=self.config, model=self.model, settings=self.settings,
                            parameters=parameters, call=call, after_build=after_build)
        if self.kind == "image":
            return text + IMAGES
        if self.kind == "masked-classify":
            return text + MASKED
        if self.kind == "audio":
            return text + AUDIO + CAUSAL_LOSS
        if self.kind == "waveform":
            return text + WAVEFORM
        target = "torch.randint(0, 4, (batch_size,))" if self.kind == "classify" else "tokens[:, 1:]"
        text += TOKENS.format(target=target)
        return text if self.kind == "classify" else text + CAUSAL_LOSS


NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
FAMILIES = (
    Family("BART", "BartConfig", "BartForCausalLM", dict(
        vocab_size=128, d_model=32, decoder_layers=4, encoder_layers=1, decoder_attention_heads=2,
        encoder_attention_heads=2, decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=32,
        is_decoder=True, is_encoder_decoder=False, **NO_DROPOUT), "causal"),
    Family("BART encoder-decoder", "BartConfig", "BartForConditionalGeneration", dict(
        vocab_size=128, d_model=32, decoder_layers=2, encoder_layers=2, decoder_attention_heads=2,
        encoder_attention_heads=2, decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=32,
        **NO_DROPOUT), "causal"),
    Family("Marian", "MarianConfig", "MarianMTModel", dict(
        vocab_size=128, decoder_vocab_size=128, d_model=32, decoder_layers=2, encoder_layers=2,
        decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=64, encoder_ffn_dim=64,
        max_position_embeddings=32, pad_token_id=0, decoder_start_token_id=0, **NO_DROPOUT), "seq2seq"),
    Family("T5", "T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, pad_token_id=0, decoder_start_token_id=0), "seq2seq"),
    Family("DistilBERT", "DistilBertConfig", "DistilBertForSequenceClassification", dict(
        vocab_size=128, dim=32, n_layers=4, n_heads=2, hidden_dim=64, max_position_embeddings=32, num_labels=4,
        dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0), "classify"),
    Family("Mistral", "MistralConfig", "MistralForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0), "causal"),
    Family("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0), "causal"),
    Family("OPT", "OPTConfig", "OPTForCausalLM", dict(
        vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
        layerdrop=0.0), "causal"),
    Family("GPT-NeoX", "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=32, attention_dropout=0.0, hidden_dropout=0.0), "causal"),
    Family("Phi", "PhiConfig", "PhiForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=32, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0), "causal"),
    Family("RoBERTa", "RobertaConfig", "RobertaForSequenceClassification", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=40, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        "classify"),
    Family("DeiT", "DeiTConfig", "DeiTForImageClassification", dict(
        image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "image",
        # transformers starts these three at zero, and the LayerNorm of an all-zero row has gradients of ~3e3:
        # training diverges at any learning rate; small random values, as a user would set them
        "embeddings = model.model.deit.embeddings\n"
        "for tensor in (embeddings.cls_token, embeddings.distillation_token, embeddings.position_embeddings):\n"
        "    torch.nn.init.normal_(tensor, std=0.02)"),
    Family("ViT", "ViTConfig", "ViTForImageClassification", dict(
        image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "image"),
    Family("Swin", "SwinConfig", "SwinForImageClassification", dict(
        image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=4,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0), "image"),
    Family("ConvNeXt", "ConvNextConfig", "ConvNextForImageClassification", dict(
        image_size=32, patch_size=4, num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], num_labels=4,
        drop_path_rate=0.0),
        "image"),
    Family("Mixtral", "MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        attention_dropout=0.0), "causal"),
    Family("Gemma2", "Gemma2Config", "Gemma2ForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, sliding_window=8,
        attention_dropout=0.0), "causal"),
    Family("Falcon", "FalconConfig", "FalconForCausalLM", dict(
        vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, hidden_dropout=0.0,
        attention_dropout=0.0), "causal"),
    Family("BLOOM", "BloomConfig", "BloomForCausalLM", dict(
        vocab_size=128, hidden_size=32, n_layer=4, n_head=4, hidden_dropout=0.0, attention_dropout=0.0), "causal"),
    Family("GPT-J", "GPTJConfig", "GPTJForCausalLM", dict(
        vocab_size=128, n_embd=32, n_layer=4, n_head=4, rotary_dim=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0), "causal"),
    Family("BERT with mask", "BertConfig", "BertForSequenceClassification", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=32, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        "masked-classify"),
    Family("Whisper", "WhisperConfig", "WhisperForConditionalGeneration", dict(
        vocab_size=128, num_mel_bins=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, decoder_start_token_id=0, **NO_DROPOUT), "audio"),
    Family("Qwen2-MoE", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=32, attention_dropout=0.0), "causal"),
    Family("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, attention_dropout=0.0), "causal"),
    Family("Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, attention_dropout=0.0), "causal"),
    Family("Phi-3", "Phi3Config", "Phi3ForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, original_max_position_embeddings=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0), "causal"),
    Family("Gemma", "GemmaConfig", "GemmaForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, attention_dropout=0.0), "causal"),
    Family("Starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, residual_dropout=0.0, embedding_dropout=0.0,
        attention_dropout=0.0), "causal"),
    Family("GPT-BigCode", "GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(
        vocab_size=128, n_embd=32, n_layer=4, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0), "causal"),
    Family("OLMo2", "Olmo2Config", "Olmo2ForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=32, attention_dropout=0.0), "causal"),
    Family("mBART", "MBartConfig", "MBartForCausalLM", dict(
        vocab_size=128, d_model=32, decoder_layers=4, encoder_layers=1, decoder_attention_heads=2,
        encoder_attention_heads=2, decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=32,
        is_decoder=True, is_encoder_decoder=False, **NO_DROPOUT), "causal"),
    Family("ALBERT", "AlbertConfig", "AlbertForSequenceClassification", dict(
        vocab_size=128, embedding_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, max_position_embeddings=32, num_labels=4, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0), "classify"),
    Family("ELECTRA", "ElectraConfig", "ElectraForSequenceClassification", dict(
        vocab_size=128, embedding_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, max_position_embeddings=32, num_labels=4, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0), "classify"),
    Family("DeBERTa-v2", "DebertaV2Config", "DebertaV2ForSequenceClassification", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=32, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pooler_dropout=0.0, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]),
        "classify"),
    Family("DINOv2", "Dinov2Config", "Dinov2ForImageClassification", dict(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, mlp_ratio=2,
        num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0), "image"),
    Family("Wav2Vec2", "Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", dict(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        num_labels=4, classifier_proj_size=16, layerdrop=0.0, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, mask_time_prob=0.0), "waveform"),
    Family("Gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, attention_dropout=0.0, sliding_window=8), "causal"),
    Family("ModernBERT", "ModernBertConfig", "ModernBertForSequenceClassification", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=32, num_labels=4, attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0,
        classifier_dropout=0.0, pad_token_id=0, local_attention=8, global_attn_every_n_layers=2), "classify"),
    Family("Mamba", "MambaConfig", "MambaForCausalLM", dict(
        vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=4, expand=2, conv_kernel=4), "causal"),
    Family("DeepSeek-V3", "DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32, attention_dropout=0.0), "causal"),
    Family("Granite", "GraniteConfig", "GraniteForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0), "causal"),
    Family("Cohere", "CohereConfig", "CohereForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0), "causal"),
    Family("GLM", "GlmConfig", "GlmForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, attention_dropout=0.0, pad_token_id=0), "causal"),
    Family("Jamba", "JambaConfig", "JambaForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        max_position_embeddings=32, attention_dropout=0.0, use_mamba_kernels=False), "causal"),
    Family("SmolLM3", "SmolLM3Config", "SmolLM3ForCausalLM", dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0, pad_token_id=0), "causal"),
)


@dataclass
class Row:
    """What one family did."""

    family: str
    model: str
    layers: str = ""
    stages: str = ""
    method: str = ""
    split_s: float = float("nan")
    moved: float = float("nan")
    max_diff: float = float("nan")
    matches: str = "no"
    note: str = ""


def two_stage_plan(model_file: ModelFile, schedule: str) -> tuple[Plan, list[str], str]:
    """The profile's layer names and the planner's straight plan on 2 devices (4 microbatches)."""
    settings = ProfileSettings(batch_size=BATCH // MICROBATCHES, device="cpu", warmup=1, iters=3, threads=1)
    profile = profile_model(model_file, settings)  # on the CPU its processes train on
    plan = partition(profile, make_cluster(2), straight=True, schedule=schedule, microbatches=MICROBATCHES)
    note = "" if len(plan.stages) == 2 else f"the planner chose {len(plan.stages)} stage(s)"
    return plan, [layer.name for layer in profile.layers], note


def train_both(model_file: ModelFile, plan: Plan, steps: int,
               device: str = "cpu") -> tuple[str, float, float, float, bool, int]:
    """(split method, split seconds, how far training moved the plain model's parameters (max |change|),
    `compare` of the two trained models, how many calls the stages keep checkpointed) after `steps` SGD steps
    pipelined and plain, both on `device`."""
    torch.manual_seed(0)
    pipelined = model_file.build_model().train()
    plain = copy.deepcopy(pipelined).to(device)
    initial = copy.deepcopy(plain)
    torch.manual_seed(1)
    inputs, target = model_file.example_batch(BATCH)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    inputs, target = tuple(tensor.to(device) for tensor in inputs), target.to(device)
    loss_fn = model_file.loss_fn or default_loss
    started = time.perf_counter()
    microbatch = tuple(tensor[: BATCH // MICROBATCHES].cpu() for tensor in inputs)  # split on the CPU, as training
    devices = [device] * len(plan.stages)
    with Pipeline.from_plan(pipelined, plan, devices, example_inputs=microbatch, loss_fn=loss_fn) as pipe:
        split_s = time.perf_counter() - started
        method = pipe.stages.method
        checkpointed = sum(isinstance(node.target, KeptModule) and node.target.checkpoint is not None
                           for stage in pipe.stages if isinstance(stage, torch.fx.GraphModule)
                           for node in stage.graph.nodes)
        for model in (pipelined, plain):
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            for _ in range(steps):
                if model is pipelined:
                    pipe.train_step(inputs, target)
                else:
                    loss_fn(model(*inputs), target).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return method, split_s, compare(initial, plain)[0], *compare(plain, pipelined), checkpointed


def model_checkpoints(model_file: ModelFile) -> bool:
    """Whether the model file's model turns on transformers' gradient checkpointing."""
    return any(getattr(module, "gradient_checkpointing", False) for module in model_file.build_model().modules())


def compare(expected: nn.Module, found: nn.Module) -> tuple[float, bool]:
    """(max |a - b| over every parameter, whether every one is within rtol 1e-5, atol 1e-6 (torch.allclose))."""
    found_params = dict(found.named_parameters())
    pairs = [(parameter, found_params[name]) for name, parameter in expected.named_parameters()]
    worst = max(float((a - b).detach().abs().max()) for a, b in pairs)
    return worst, all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)


def run_family(family: Family, folder: Path, steps: int, schedule: str, device: str = "cpu",
               checkpointing: str = "none") -> Row:
    """The whole path for one family; a failure ends up in the row's note."""
    row = Row(family.name, family.model)
    if checkpointing != "none":
        reentrant = CHECKPOINTING.format(reentrant=checkpointing == "reentrant")
        family = dataclasses.replace(family, after_build=family.after_build + reentrant)
    path = folder / f"{family.name.lower().replace('-', '_')}.py"
    path.write_text(textwrap.dedent(family.model_file_text()))
    try:
        model_file = load_model_file(path)
        plan, names, row.note = two_stage_plan(model_file, schedule)
        shown = ", ".join(names[:3])
        row.layers = f"{len(names)}: {shown}, ..., {names[-1]}"
        row.stages = " ; ".join(f"{stage.first_layer} .. {stage.last_layer}" for stage in plan.stages)
        row.method, row.split_s, row.moved, row.max_diff, close, checkpointed = train_both(model_file, plan, steps,
                                                                                           device)
        row.matches = "yes" if close else "no"
        if checkpointing != "none":
            found = ("the model does not checkpoint" if not model_checkpoints(model_file) else
                     "layers run whole, checkpointed as the model runs them" if row.method == "fx" else
                     f"{checkpointed} calls kept checkpointed")
            row.note = found + (f"; {row.note}" if row.note else "")
    except Exception as exc:  # report and go on: one line per failing family
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        row.note = f"{type(exc).__name__}: {first_line[:200]}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="comma-separated names (default: all)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--device", default="cpu", help="where both train (the profile is taken on the CPU)")
    parser.add_argument("--checkpointing", choices=("none", "reentrant", "non-reentrant"), default="none",
                        help="turn on transformers' gradient checkpointing in every model file")
    parser.add_argument("--keep", type=Path, default=None,
                        help="write the model files into this folder and keep them (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # fp32 compared on a GPU too
    wanted = {name.strip().lower() for name in args.families.split(",") if name.strip()}
    unknown = sorted(wanted - {family.name.lower() for family in FAMILIES})
    if unknown:
        parser.error(f"unknown families {', '.join(unknown)}; known: {', '.join(f.name for f in FAMILIES)}")
    chosen = [family for family in FAMILIES if not wanted or family.name.lower() in wanted]
    print(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, {args.device}, "
          f"checkpointing {args.checkpointing}; "
          f"{args.steps} SGD steps of a batch of {BATCH} in {MICROBATCHES} microbatches, {args.schedule}\n")
    print("| family | model | layers found | plan's stages | split | split s | training moved | pipelined - plain "
          "| matches plain PyTorch | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(str(args.keep)) if args.keep is not None
          else tempfile.TemporaryDirectory(prefix="model-families-")) as folder:
        for family in chosen:
            print(f"{family.name} ...", file=sys.stderr, flush=True)
            row = run_family(family, Path(folder), args.steps, args.schedule, args.device, args.checkpointing)
            print(f"| {row.family} | {row.model} | {row.layers} | {row.stages} | {row.method} | {row.split_s:.2f} | "
                  f"{row.moved:.1e} | {row.max_diff:.1e} | {row.matches} | {row.note} |", flush=True)


if __name__ == "__main__":
    main()
