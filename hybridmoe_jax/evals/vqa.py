"""Visual question answering on held-out generated scenes (hybridmoe_jax.data.images).

Each held-out image (seed different from the training seed, so never trained on) is asked
every question of its scene: count ("how many digits?"), where ("digit at top left?") and
colour ("colour at top left?"). The prompt is exactly the training format,
BOS "Q: <question>\\n" <image> "\\nA:", and the answer is the greedy continuation up to a
newline, compared by exact match.

Baseline ("blank image"): the same model, same prompt, with the image replaced by an
all-black image of the same size. The weights, the question text and the number of image
tokens are identical, so the gap to it is exactly what the model reads from the pixels; a
separately trained text-only model would also differ in its training data and seed. Chance
(uniform over the answer classes) and the majority-class rate of the held-out answers are
reported too.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from hybridmoe_jax.data import images as images_lib
from hybridmoe_jax.data import multimodal
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.infer import Engine

CHANCE = {"count": 1 / 4, "where": 1 / 10, "colour": 1 / len(images_lib.COLOURS)}


def answer(engine: Engine, processor: multimodal.Processor, image: np.ndarray,
           question: str, max_new_tokens: int = 8) -> str:
  """Greedy answer of the model to `question` about `image` (text up to the newline)."""
  tok = processor.tokenizer
  doc = processor(images_lib.vqa_text(question), [image], eos=False)
  batch = multimodal.inference_batch(doc, processor.vision)
  newline = tok.encode("\n")  # a stop token when "\n" is one token (always for bytes)
  stops = [tok.eos_id] + ([int(newline[0])] if len(newline) == 1 else [])
  out = engine.generate(doc.tokens, max_new_tokens=max_new_tokens, images=batch,
                        stop_tokens=stops, pad_id=tok.pad_id)
  n = int(out.lengths[0])
  return tok.decode(out.tokens[0, :n]).split("\n")[0].strip()


def swap_quadrants(image: np.ndarray, a: int, b: int) -> np.ndarray:
  """Swap quadrants a and b (CELL_NAMES order) of a square image [S, S, C]."""
  out = image.copy()
  c = image.shape[0] // 2
  sl = lambda k: (slice((k // 2) * c, (k // 2 + 1) * c), slice((k % 2) * c, (k % 2 + 1) * c))
  out[sl(a)], out[sl(b)] = image[sl(b)], image[sl(a)]
  return out


def quadrant_swap(engine: Engine, *, num_images: int, seed: int, sides, channels: int,
                  tokenizer: Tokenizer | None = None) -> dict[str, dict[str, Any]]:
  """Does the model read 2-D position? Each position question type ("where": which digit,
  "colour") is asked about the top-left cell of scenes whose top-left and bottom-right cells
  hold different answers, before and after swapping those two quadrants.

  Returns per type the scenes used, the fraction of answers that change, and the fraction
  correct before / after (after the swap the correct answer is the former bottom-right one).
  """
  proc = multimodal.Processor(engine.cfg.vision, tokenizer=tokenizer)
  src = images_lib.SyntheticVQASource(1 << 30, seed=seed, sides=sides, channels=channels)
  out = {}
  for kind in ("where", "colour"):
    q = f"{'digit' if kind == 'where' else 'colour'} at {images_lib.CELL_NAMES[0]}?"
    changed = before = after = n = i = 0
    while n < num_images:
      truth = src.truth(i)
      i += 1
      cells = truth.digits if kind == "where" else truth.colours
      tl, br = cells[0], cells[3]
      if tl is None or br is None or tl == br:
        continue
      img = images_lib.render_scene(truth, channels)
      a0 = answer(engine, proc, img, q)
      a1 = answer(engine, proc, swap_quadrants(img, 0, 3), q)
      changed += a0 != a1
      before += a0 == str(tl)
      after += a1 == str(br)
      n += 1
    out[kind] = {"scenes": n, "answer_changed": changed / n, "correct_before": before / n,
                 "correct_after_swap": after / n}
  return out


def evaluate_vqa(engine: Engine, *, num_images: int, seed: int, sides, channels: int,
                 max_new_tokens: int = 8, keep_examples: int = 12,
                 tokenizer: Tokenizer | None = None) -> dict[str, Any]:
  """Exact-match accuracy per question type, with the blank-image baseline and chance.

  Args:
    engine: an Engine over a vision model.
    num_images: held-out scenes (every question of each is asked).
    seed: scene seed (use one the model was not trained on).
    sides: image sides to draw (pixels).
    channels: image channels of the model.
    tokenizer: the model's, with image roles (default: bytes with vision).
  """
  vision = engine.cfg.vision
  if not vision.enabled:
    raise ValueError("--task=vqa needs a vision model (model.vision.enabled = True)")
  if num_images < 1:
    raise ValueError(f"num_images must be >= 1, got {num_images}")
  proc = multimodal.Processor(vision, tokenizer=tokenizer)
  src = images_lib.SyntheticVQASource(num_images, seed=seed, sides=sides, channels=channels)
  hits = collections.defaultdict(lambda: [0, 0, 0])  # type -> [correct, blank correct, n]
  answers = collections.defaultdict(collections.Counter)
  examples = []
  for i in range(num_images):
    truth = src.truth(i)
    img = images_lib.render_scene(truth, channels)
    blank = np.zeros_like(img)
    for kind, q, a in images_lib.questions(truth):
      got = answer(engine, proc, img, q, max_new_tokens)
      got_blank = answer(engine, proc, blank, q, max_new_tokens)
      h = hits[kind]
      h[0] += got == a
      h[1] += got_blank == a
      h[2] += 1
      answers[kind][a] += 1
      if len(examples) < keep_examples:
        examples.append({"image": i, "side": truth.side, "question": q, "answer": a,
                         "model": got, "blank_image": got_blank})
  per_type = {}
  for kind in images_lib.QUESTION_TYPES:
    c, cb, n = hits[kind]
    if not n:
      continue
    per_type[kind] = {"questions": n, "accuracy": c / n, "blank_image_accuracy": cb / n,
                      "chance": CHANCE[kind],
                      "majority": answers[kind].most_common(1)[0][1] / n}
  total = sum(h[2] for h in hits.values())
  return {"per_type": per_type, "images": num_images, "questions": total,
          "accuracy": sum(h[0] for h in hits.values()) / total,
          "blank_image_accuracy": sum(h[1] for h in hits.values()) / total,
          "seed": seed, "sides": list(sides), "baseline": "same model, all-black image",
          "quadrant_swap": quadrant_swap(engine, num_images=min(num_images, 32), seed=seed,
                                         sides=sides, channels=channels,
                                         tokenizer=tokenizer),
          "examples": examples}


def format_vqa(r: dict[str, Any]) -> str:
  lines = [f"{'type':>7} {'n':>5} {'model':>7} {'blank':>7} {'chance':>7} {'majority':>8}"]
  for kind, v in r["per_type"].items():
    lines.append(f"{kind:>7} {v['questions']:>5} {v['accuracy']:>7.3f} "
                 f"{v['blank_image_accuracy']:>7.3f} {v['chance']:>7.3f} {v['majority']:>8.3f}")
  lines.append(f"{'all':>7} {r['questions']:>5} {r['accuracy']:>7.3f} "
               f"{r['blank_image_accuracy']:>7.3f}")
  for kind, sw in r.get("quadrant_swap", {}).items():
    lines.append(f"swap top-left <-> bottom-right, {kind} ({sw['scenes']} scenes): answer "
                 f"changed {sw['answer_changed']:.3f}, correct before "
                 f"{sw['correct_before']:.3f}, after {sw['correct_after_swap']:.3f}")
  return "\n".join(lines)
