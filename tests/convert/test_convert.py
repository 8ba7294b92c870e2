"""Hugging Face Kimi-Linear interop: round trips, mlx-lm agreement, our presets, errors."""

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import (AttnResConfig, ConfigError, KDAConfig, MLAConfig, MoEConfig,
                                  ModelConfig, model_config_from_dict)
from hybridmoe_jax.convert import convert, hf_config, hf_weights
from hybridmoe_jax.loading import load_from_params, load_hf_model
from hybridmoe_jax.infer import Engine
from hybridmoe_jax.io.safetensors import CheckpointReader
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.config.sharding import path_string
from hybridmoe_jax.train.params_export import export_params
from hybridmoe_jax.train.state import split_model
from tests.convert.kimi_tiny import tiny_hf_config, tiny_hf_weights, write_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT_LEN = 80        # > one KDA chunk (compute.kda_chunk_size = 64): a chunk boundary
N_NEW = 8


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  return write_hf_dir(tmp_path_factory.mktemp("kimi") / "hf")


@pytest.fixture(scope="module")
def ours_dir(hf_dir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("ours") / "export")
  convert.from_hf(hf_dir, out)
  return out


def _prompt():
  return np.random.default_rng(1).integers(0, 97, PROMPT_LEN).astype(np.int32)


def test_rules_cover_exactly_our_model():
  """The mapping's names and shapes on our side are the model's leaves, no more, no less."""
  cfg = hf_config.model_config_from_hf(tiny_hf_config())
  _, params, biases, _ = split_model(nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
  leaves = {}
  for prefix, tree in ((hf_weights.P, params), (hf_weights.B, biases)):
    for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree))[0]:
      leaves[prefix + path_string(p)] = tuple(x.shape)
  mapped = {n: r.shapes[n] for r in hf_weights.weight_rules(cfg) for n in r.ours}
  assert mapped == leaves
  hf = {n: r.shapes[n] for r in hf_weights.weight_rules(cfg) for n in r.hf}
  assert hf == {k: v.shape for k, v in tiny_hf_weights(tiny_hf_config()).items()}


def test_hf_to_ours_to_hf_is_bit_exact(hf_dir, ours_dir, tmp_path):
  back = str(tmp_path / "back")
  convert.to_hf(ours_dir, back)
  with CheckpointReader(hf_dir) as a, CheckpointReader(back) as b:
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
      x, y = a.read(name), b.read(name)
      assert (x.dtype, x.shape) == (y.dtype, y.shape), name
      assert x.tobytes() == y.tobytes(), name
  # config.json comes back field for field; the tokenizer files travel both ways.
  assert json.load(open(os.path.join(back, "config.json"))) == tiny_hf_config()
  assert os.path.isfile(os.path.join(ours_dir, "tokenizer", "tokenizer_config.json"))
  assert os.path.isfile(os.path.join(back, "tokenizer_config.json"))


def _read_dir(path):
  """(config.json, {name: (dtype, shape, bytes)}) of an HF dir."""
  with CheckpointReader(path) as r:
    tensors = {n: (r.info(n).dtype, tuple(r.info(n).shape), r.read(n).tobytes())
               for n in r.tensors}
  return json.load(open(os.path.join(path, "config.json"))), tensors


@pytest.mark.parametrize("change", [
    {}, {"num_shared_experts": None}, {"head_dim": 72},
    {"num_experts_per_token": 1, "moe_renormalize": True},
    {"num_shared_experts": 0, "moe_renormalize": False, "rope_theta": None}],
    ids=["reference", "shared-null", "head_dim-unread", "top1-renormalize", "shared-0"])
def test_import_export_import_is_the_identity(change, tmp_path):
  """config.json and every tensor survive HF -> ours -> HF -> ours, on the reference config
  and the variants a released config carries (null shared count, unread head_dim, top-1)."""
  hf = write_hf_dir(tmp_path / "hf", tiny_hf_config(**change), shards=1)
  convert.from_hf(hf, str(tmp_path / "ours"))
  convert.to_hf(str(tmp_path / "ours"), str(tmp_path / "back"))
  config, tensors = _read_dir(hf)
  config_back, tensors_back = _read_dir(tmp_path / "back")
  assert config_back == config == tiny_hf_config(**change)
  assert tensors_back == tensors
  convert.from_hf(str(tmp_path / "back"), str(tmp_path / "again"))
  for name in (convert.MODEL_CONFIG, convert.HF_EXTRA):
    assert (json.load(open(tmp_path / "ours" / name)) ==
            json.load(open(tmp_path / "again" / name))), name
  assert (open(tmp_path / "ours" / convert.PARAMS_FILE, "rb").read() ==
          open(tmp_path / "again" / convert.PARAMS_FILE, "rb").read())


def test_generated_config_keeps_hf_conventions():
  """Without an imported config.json (our own presets, old exports holding only the fields
  without effect on the forward): no shared experts export as null, the passthrough fields
  stay, and an imported config that no longer describes the model is not reused."""
  no_shared = _kimi_like(num_shared_experts=0)
  hf = hf_config.export_config(no_shared, {"rope_theta": 5.0, "bos_token_id": 7})
  assert hf["num_shared_experts"] is None and (hf["rope_theta"], hf["bos_token_id"]) == (5.0, 7)
  assert hf_config.model_config_from_hf(hf).moe.num_shared_experts == 0
  imported = tiny_hf_config(head_dim=72)
  cfg = hf_config.model_config_from_hf(imported)
  assert hf_config.export_config(cfg, imported) == imported
  # The same model trained with QB balancing still exports the imported file.
  qb = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, balancing="qb"))
  assert hf_config.export_config(qb, imported) == imported
  wider = dataclasses.replace(cfg, d_model=64)
  out = hf_config.export_config(wider, imported)
  assert out["hidden_size"] == 64 and out["head_dim"] == cfg.mla.qk_nope_head_dim
  assert out["rope_theta"] == imported["rope_theta"]


def test_export_loads_like_the_hf_dir(hf_dir, ours_dir):
  """--from_hf output is a normal params export; it and load_hf_model give one model."""
  a, info = load_from_params(ours_dir)
  b, hf_info = load_hf_model(hf_dir)
  assert info["source"] == "params" and hf_info["hf_config"]["model_type"] == "kimi_linear"
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(a)),
               nnx.to_pure_dict(nnx.state(b)))
  bias = np.asarray(a.layers[1].ffn.bias[...])
  want = tiny_hf_weights(tiny_hf_config())["model.layers.1.block_sparse_moe.gate."
                                           "e_score_correction_bias"]
  np.testing.assert_array_equal(bias, want)            # the correction bias is our bias state


def _mlx_python():
  """A python that imports mlx_lm: this one (CI installs the mlx extra), else
  $HYBRIDMOE_MLX_PYTHON (e.g. a side venv); None if there is none."""
  if importlib.util.find_spec("mlx_lm") is not None:
    return sys.executable
  cand = os.environ.get("HYBRIDMOE_MLX_PYTHON")
  return cand if cand and os.path.isfile(cand) else None


@pytest.mark.skipif(_mlx_python() is None, reason="mlx-lm is not installed (pip install -e "
                    "'.[mlx]', or set HYBRIDMOE_MLX_PYTHON to a python that has it)")
def test_logits_and_greedy_match_mlx_lm(hf_dir, ours_dir, tmp_path):
  """Our converted model vs mlx-lm's kimi_linear on the same random checkpoint, both fp32.
  (~25 s on 2 cores, most of it the mlx subprocess importing mlx-lm, which imports
  transformers; it skips where mlx-lm is absent, e.g. CI's dev extra.)

  Tolerance: |ours - mlx| <= 5e-5 everywhere (logits here are O(4)). Both compute in fp32
  from identical values (the BF16 weights are exact in fp32) but sum in different orders:
  our chunked KDA (64-token chunks, WY form) vs mlx's token recurrence, fused vs separate
  attention softmax, and roundings compound over 5 layers; measured max 4.5e-6, mean 6e-7
  (BENCHMARKS.md), so 5e-5 leaves 10x margin yet catches any real mismatch (a wrong
  layout, eps or scale moves logits by 1e-2 or more).
  """
  tokens = _prompt()
  np.save(tmp_path / "tokens.npy", tokens)
  out = tmp_path / "mlx.npz"
  p = subprocess.run([_mlx_python(), os.path.join(ROOT, "tests", "convert", "mlx_reference.py"),
                      hf_dir, str(tmp_path / "tokens.npy"), str(N_NEW), str(out)],
                     capture_output=True, text=True, timeout=600, check=False)
  assert p.returncode == 0, p.stderr[-3000:]
  ref = np.load(out)
  model, _ = load_from_params(ours_dir)
  logits, aux = model(jnp.asarray(tokens)[None])
  diff = np.abs(np.asarray(logits[0]) - ref["logits"])
  assert diff.max() <= 5e-5, (diff.max(), diff.mean())
  # Routing is exercised: every MoE layer sends tokens to most of its 6 experts.
  for stats in aux["moe"]["layers"].values():
    assert np.count_nonzero(np.asarray(stats["ffn"]["bias"]["load"])) >= 4
  engine = Engine(model, max_len=len(tokens) + N_NEW)
  greedy = engine.generate(tokens[None], max_new_tokens=N_NEW).tokens[0]
  np.testing.assert_array_equal(greedy, ref["greedy"])


def _kimi_like(**moe) -> ModelConfig:
  """A tiny preset of ours that Kimi-Linear can express."""
  return ModelConfig(vocab_size=61, d_model=32, num_layers=4, norm_eps=1e-5,
                     kda=KDAConfig(num_heads=2, num_v_heads=2, head_dim=8, v_head_dim=8,
                                   gate="unbounded", output_gate_rank=0),
                     mla=MLAConfig(num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8,
                                   qk_rope_head_dim=4, v_head_dim=8, output_gate=False),
                     moe=MoEConfig(num_experts=4, experts_per_token=2, expert_intermediate=16,
                                   shared_intermediate=32, glu="swiglu", balancing="qb",
                                   **moe),
                     attnres=AttnResConfig(enabled=False))


def test_our_preset_exports_to_hf_and_back(tmp_path):
  cfg = _kimi_like(routed_scale=1.5)
  # Random values set from numpy into the abstract model (an eager init compiles every op).
  graphdef, params, biases, rest = split_model(
      nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(3)
  rand = lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32) * 0.3)
  nnx.replace_by_pure_dict(params, jax.tree.map(rand, nnx.to_pure_dict(params)))
  nnx.replace_by_pure_dict(biases, jax.tree.map(rand, nnx.to_pure_dict(biases)))
  model = nnx.merge(graphdef, params, biases, rest)
  src = export_params(str(tmp_path / "export"), params, biases, dataclasses.asdict(cfg))
  summary = convert.to_hf(src, str(tmp_path / "hf"), dtype="bfloat16")
  hf = json.load(open(tmp_path / "hf" / "config.json"))
  assert hf["num_shared_experts"] == 2 and hf["moe_intermediate_size"] == 16
  with CheckpointReader(tmp_path / "hf") as r:
    assert r.info("model.layers.1.self_attn.A_log").dtype == "F32"
    assert r.info("model.layers.1.self_attn.q_proj.weight").dtype == "BF16"
  assert summary["tensors"] == len(r.tensors)
  convert.to_hf(src, str(tmp_path / "hf32"))
  back, _ = load_hf_model(str(tmp_path / "hf32"))
  tokens = jnp.asarray(_prompt()[:20] % cfg.vocab_size)[None]
  forward = nnx.jit(lambda m, t: m(t)[0])     # one compilation serves both (same graph)
  np.testing.assert_array_equal(np.asarray(forward(back, tokens)),
                                np.asarray(forward(model, tokens)))
  # The config maps back to an equivalent one (balancing is a training rule: "sign" there).
  again = hf_config.model_config_from_hf(hf)
  assert again.moe.num_shared_experts * again.moe.shared_intermediate == 32
  assert again.kda.decay_rank == cfg.kda.decay_rank and again.layer_kinds == cfg.layer_kinds


def test_48b_preset_config_maps_both_ways():
  from configs.kimi_linear_48b import get_config  # pylint: disable=import-outside-toplevel
  cfg = model_config_from_dict(get_config().model)
  hf = hf_config.hf_config_from_model(cfg)
  assert (hf["num_experts"], hf["num_experts_per_token"], hf["kv_lora_rank"],
          hf["linear_attn_config"]["head_dim"], hf["first_k_dense_replace"]) == (
              256, 8, 512, 128, 1)
  assert hf_config.model_config_from_hf(hf) == cfg


@pytest.mark.parametrize("field,change", [
    ("model.attnres.enabled", dict(attnres=AttnResConfig(enabled=True))),
    ("model.moe.glu", dict(moe=MoEConfig(glu="situ"))),
    ("model.moe.latent_dim", dict(moe=MoEConfig(glu="swiglu", latent_dim=16))),
    ("model.kda.gate", dict(kda=KDAConfig(gate="bounded"))),
    ("model.mla.output_gate", dict(mla=MLAConfig(output_gate=True))),
    ("model.mla.q_lora_rank", dict(mla=MLAConfig(output_gate=False, q_lora_rank=8))),
    ("model.mla.rope_theta", dict(mla=MLAConfig(output_gate=False, rope_theta=1e4))),
    ("model.mla.logn_base", dict(mla=MLAConfig(output_gate=False, logn_base=4096))),
    ("model.kda.output_gate_rank", dict(kda=KDAConfig(gate="unbounded"))),
])
def test_inexpressible_exports_fail_naming_the_field(field, change):
  base = _kimi_like()
  cfg = dataclasses.replace(base, **change)
  with pytest.raises(hf_config.UnsupportedConfig, match=f"`{field}` = .* is not supported"):
    hf_config.hf_config_from_model(cfg)


@pytest.mark.parametrize("field,value", [
    ("mla_use_nope", False), ("moe_router_activation_func", "softmax"),
    ("tie_word_embeddings", True), ("moe_layer_freq", 2), ("q_lora_rank", 64),
    ("model_type", "deepseek_v3")])
def test_unsupported_hf_config_values(field, value, tmp_path):
  cfg = tiny_hf_config(**{field: value})
  with pytest.raises(hf_config.UnsupportedConfig, match=f"`{field}` = {value!r} is not supported"):
    hf_config.model_config_from_hf(cfg)
  weird = tiny_hf_config(linear_attn_config=dict(tiny_hf_config()["linear_attn_config"],
                                                 use_full_rank_gate=True))
  with pytest.raises(ConfigError, match="linear_attn_config.use_full_rank_gate"):
    hf_config.model_config_from_hf(weird)


def test_tensor_errors_name_every_tensor(tmp_path):
  cfg = tiny_hf_config()
  w = tiny_hf_weights(cfg)
  w["model.layers.0.self_attn.extra.weight"] = w.pop("model.layers.4.self_attn.kv_b_proj.weight")
  w["model.layers.0.self_attn.q_proj.weight"] = w["model.layers.0.self_attn.q_proj.weight"][:5]
  src = write_hf_dir(tmp_path / "hf", cfg, w, shards=1)
  with pytest.raises(hf_weights.TensorMismatch) as e:
    convert.from_hf(src, str(tmp_path / "out"))
  msg = str(e.value)
  assert "1 unknown tensor(s) (not part of this config's model): model.layers.0.self_attn.extra" in msg
  assert "1 missing tensor(s): model.layers.4.self_attn.kv_b_proj.weight" in msg
  assert "model.layers.0.self_attn.q_proj.weight [5, 32] (expected [32, 32])" in msg
  assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.partial")


def test_cli_refuses_an_existing_output_and_reports_one_line(hf_dir, ours_dir, tmp_path):
  run = lambda *a: subprocess.run([sys.executable, "-m", "hybridmoe_jax.convert", *a], cwd=ROOT,
                                  capture_output=True, text=True, timeout=300, check=False)
  p = run("--from_hf", hf_dir, "--to", ours_dir)
  assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
  assert f"output {ours_dir} exists; refusing to overwrite it" in p.stderr
  bad = tmp_path / "bad"
  shutil.copytree(hf_dir, bad)
  cfg = json.load(open(bad / "config.json"))
  (bad / "config.json").write_text(json.dumps({**cfg, "mla_use_nope": False}))
  p = run("--from_hf", str(bad), "--to", str(tmp_path / "o"))
  assert p.returncode == 2 and "`mla_use_nope` = False is not supported" in p.stderr
  p = run("--to_hf", str(tmp_path / "h"), "--from", ours_dir)
  assert p.returncode == 0, p.stderr
  summary = json.loads(p.stdout)
  assert summary["tensors"] == len(tiny_hf_weights(tiny_hf_config())) and summary["peak_rss_bytes"] > 0


_LIN = tiny_hf_config()["linear_attn_config"]


@pytest.mark.parametrize("field,change", [
    ("num_experts", {"num_experts": "6"}),
    ("num_hidden_layers", {"num_hidden_layers": "5"}),
    ("num_hidden_layers", {"num_hidden_layers": 5.0}),
    ("rms_norm_eps", {"rms_norm_eps": "1e-5x"}),
    ("routed_scaling_factor", {"routed_scaling_factor": [2.0]}),
    ("num_expert_group", {"num_expert_group": "2"}),
    ("topk_group", {"num_expert_group": 2, "topk_group": "1"}),
    ("num_experts_per_token", {"num_experts_per_token": "2"}),
    ("moe_renormalize", {"moe_renormalize": "false"}),
    ("use_grouped_topk", {"use_grouped_topk": "false"}),
    ("linear_attn_config", {"linear_attn_config": 3}),
    ("linear_attn_config", {"linear_attn_config": "kda"}),
    ("linear_attn_config.kda_layers", {"linear_attn_config": {**_LIN, "kda_layers": 3}}),
    ("linear_attn_config.kda_layers",
     {"linear_attn_config": {**_LIN, "kda_layers": [[1], 3, 4]}}),
    ("linear_attn_config.kda_layers",
     {"linear_attn_config": {**_LIN, "kda_layers": [True, 3, 4]}}),
    ("linear_attn_config.full_attn_layers",
     {"linear_attn_config": {**_LIN, "full_attn_layers": 5}}),
    ("linear_attn_config.full_attn_layers",
     {"linear_attn_config": {**_LIN, "full_attn_layers": [2, "5"]}}),
])
def test_hostile_hf_config_types_fail_naming_the_field(field, change):
  """Wrong JSON types in config.json: one UnsupportedConfig naming the HF field, never a
  TypeError from inside (nor a "false" string read as true)."""
  with pytest.raises(hf_config.UnsupportedConfig, match=f"`{field}` = .* is not supported"):
    hf_config.model_config_from_hf(tiny_hf_config(**change))


@pytest.mark.parametrize("hf_field,ours,change", [
    ("hidden_size", "model.d_model", {"hidden_size": -32}),
    ("num_experts_per_token", "model.moe.experts_per_token", {"num_experts_per_token": 7}),
    ("linear_attn_config.num_heads", "model.kda.num_heads",
     {"linear_attn_config": {**_LIN, "num_heads": None}}),
    ("first_k_dense_replace", "model.moe.first_dense_layers", {"first_k_dense_replace": 9}),
])
def test_refused_hf_config_names_hf_and_our_field(hf_field, ours, change):
  with pytest.raises(ConfigError, match=f"`{hf_field}`.*`{ours}`"):
    hf_config.model_config_from_hf(tiny_hf_config(**change))


@pytest.mark.parametrize("doc", [[1, 2], "kimi_linear", None])
def test_config_json_not_an_object_is_one_line_error(doc, tmp_path):
  src = write_hf_dir(tmp_path / "hf", shards=1)
  with open(os.path.join(src, "config.json"), "w") as f:
    json.dump(doc, f)
  with pytest.raises(hf_config.UnsupportedConfig, match="not a JSON object"):
    convert.from_hf(src, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")
