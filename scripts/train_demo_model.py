"""Train the small demo checkpoint that ships in checkpoints/redline/tiny-python/.

The model is a genuine Hugging Face ``LlamaForCausalLM`` (GQA, tied embeddings,
default rope) trained on the Python standard library of the machine this runs
on, with a SentencePiece BPE tokenizer trained on the training files only. The
output directory holds what ``save_pretrained`` writes (config.json,
model.safetensors, maybe generation_config.json) plus tokenizer.model and
recipe.json, which records how the checkpoint was made and how well it does on
held-out files.

Usage (on a CUDA machine):

    python scripts/train_demo_model.py --out checkpoints/redline/tiny-python

On an H200 the 12-epoch cap (--max_epochs), not the --minutes budget, ends the run:
about 35M tokens in ~30 s of training, ~50 s in all. --minutes only matters on slower
devices, where the cosine schedule is planned to end inside the budget.

A CPU smoke run (tiny, only to check that the script works end to end):

    python scripts/train_demo_model.py --out /tmp/tiny --allow_cpu \
        --minutes 0.2 --max_files 50 --batch_size 4 --seq_len 128
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

# Fixed architecture of the demo model (~8M parameters, 16 MB in bf16).
MODEL_SHAPE = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=704,  # 2.75 x hidden, a multiple of 64
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,  # GQA
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
)

HELDOUT_BUCKETS = 1000
HELDOUT_PER_MILLE = 30  # ~3% of files are held out
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- data


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def list_stdlib_files(root: Path, include_idlelib: bool) -> list[str]:
    """All *.py under the stdlib, as sorted relative posix paths."""
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        parts = rel.parts[:-1]
        if any(p in EXCLUDED_DIRS for p in parts):
            continue
        if not include_idlelib and parts and parts[0] == "idlelib":
            continue
        if not path.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel: str) -> bool:
    h = int.from_bytes(hashlib.sha1(rel.encode("utf-8")).digest()[:8], "big")
    return h % HELDOUT_BUCKETS < HELDOUT_PER_MILLE


def read_texts(root: Path, rels: list[str]) -> tuple[list[str], list[str], int]:
    """Read files as UTF-8; skip undecodable and empty ones. Returns (rels, texts, n_bytes)."""
    kept, texts, nbytes = [], [], 0
    for rel in rels:
        try:
            raw = (root / rel).read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        kept.append(rel)
        texts.append(text)
        nbytes += len(raw)
    return kept, texts, nbytes


# ------------------------------------------------------------------------ tokenizer


def tokenizer_settings(vocab_size: int, num_threads: int) -> dict:
    return dict(
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        add_dummy_prefix=False,  # code: a line's indentation must tokenize the same everywhere
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=0.99995,
        max_sentence_length=4192,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=num_threads,
    )


def sample_lines(texts: list[str], char_budget: int, seed: int) -> list[str]:
    """Non-empty lines of the training files, a deterministic random sample up to char_budget chars."""
    lines = [ln for t in texts for ln in t.split("\n") if ln.strip() and len(ln.encode("utf-8")) < 4192]
    total = sum(len(ln) for ln in lines)
    if total <= char_budget:
        return lines
    rng = random.Random(seed)
    idx = list(range(len(lines)))
    rng.shuffle(idx)
    out, n = [], 0
    for i in idx:
        if n >= char_budget:
            break
        out.append(lines[i])
        n += len(lines[i])
    return out


def train_tokenizer(lines: list[str], settings: dict, workdir: Path) -> Path:
    import sentencepiece as spm

    prefix = workdir / "spm"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        minloglevel=2,
        **settings,
    )
    return prefix.with_suffix(".model")


# --------------------------------------------------------------------------- helpers


def atomic_write_text(path: Path, text: str) -> None:
    from checkpoint import write_atomically

    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def lr_at(step: int, peak: float, min_lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (peak - min_lr) * (1.0 + math.cos(math.pi * progress))


def build_config(max_position_embeddings: int):
    from transformers import LlamaConfig

    shape = dict(MODEL_SHAPE, max_position_embeddings=max_position_embeddings)
    return LlamaConfig(
        **shape,
        pad_token_id=None,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
    )


# ---------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory, e.g. checkpoints/redline/tiny-python")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget for the training loop")
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=64, help="sequences per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min_lr_ratio", type=float, default=0.1, help="final lr as a fraction of the peak")
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--max_epochs", type=float, default=12.0,
                   help="cap on passes over the training tokens: the stdlib is only ~3M tokens, and on an "
                        "H200 (2.3M tok/s) held-out loss was lowest near epoch 8 and rose steadily after "
                        "epoch ~10; a 30-epoch run ended at held-out ppl 185 against 25 for 12 epochs")
    p.add_argument("--spm_chars", type=int, default=20_000_000,
                   help="characters of training lines used to train the tokenizer")
    p.add_argument("--max_files", type=int, default=None, help="use only this many files (smoke runs)")
    p.add_argument("--include_idlelib", action="store_true")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile the training step (auto: on for CUDA)")
    p.add_argument("--eval_every", type=int, default=0, help="steps between held-out evals (0: ~12 per run)")
    p.add_argument("--allow_cpu", action="store_true", help="run without CUDA (tiny smoke runs only)")
    args = p.parse_args(argv)
    if args.minutes <= 0:
        p.error("--minutes must be positive")
    if not 16 <= args.seq_len <= 1024:
        p.error("--seq_len must be in [16, 1024] (max_position_embeddings is 1024)")
    if args.batch_size < 1:
        p.error("--batch_size must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("error: CUDA is not available; pass --allow_cpu for a tiny smoke run on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_cuda = device.type == "cuda"
    use_compile = args.compile == "on" or (args.compile == "auto" and use_cuda)
    device_name = torch.cuda.get_device_name(device) if use_cuda else platform.processor() or "cpu"

    import transformers
    from transformers import LlamaForCausalLM
    import sentencepiece as spm

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    out_dir = Path(args.out)
    log(f"[setup] python {platform.python_version()} torch {torch.__version__} "
        f"transformers {transformers.__version__} sentencepiece {spm.__version__} device {device_name}")

    # ---- files and the held-out split
    root = stdlib_dir()
    rels = list_stdlib_files(root, args.include_idlelib)
    train_rels = [r for r in rels if not is_heldout(r)]
    held_rels = [r for r in rels if is_heldout(r)]
    if args.max_files is not None:
        k = max(1, round(args.max_files * HELDOUT_PER_MILLE / HELDOUT_BUCKETS))
        held_rels = held_rels[:k]
        train_rels = train_rels[: max(1, args.max_files - k)]
    train_rels, train_texts, train_bytes = read_texts(root, train_rels)
    held_rels, held_texts, held_bytes = read_texts(root, held_rels)
    if not train_texts or not held_texts:
        print(f"error: found too few stdlib files under {root}", file=sys.stderr)
        return 2
    log(f"[data] stdlib {root}: {len(train_rels)} training files ({train_bytes / 1e6:.2f} MB), "
        f"{len(held_rels)} held-out files ({held_bytes / 1e6:.2f} MB)")

    # ---- tokenizer
    t0 = time.time()
    sp_settings = tokenizer_settings(MODEL_SHAPE["vocab_size"], os.cpu_count() or 1)
    lines = sample_lines(train_texts, args.spm_chars, args.seed)
    work = Path(tempfile.mkdtemp(prefix="redline-train-"))
    try:
        spm_path = train_tokenizer(lines, sp_settings, work)
        sp = spm.SentencePieceProcessor(model_file=str(spm_path))
        assert sp.get_piece_size() == MODEL_SHAPE["vocab_size"], sp.get_piece_size()
        assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
        spm_chars_used = sum(len(x) for x in lines)
        spm_lines_used = len(lines)
        log(f"[tokenizer] BPE vocab {sp.get_piece_size()} from {len(lines)} lines "
            f"({spm_chars_used / 1e6:.2f} M chars) in {time.time() - t0:.1f}s")

        # ---- encode: BOS + file + EOS, concatenated
        t0 = time.time()
        nthreads = os.cpu_count() or 1

        def encode_stream(texts: list[str]) -> list[int]:
            ids: list[int] = []
            for doc in sp.encode(texts, num_threads=nthreads):
                ids.append(1)
                ids.extend(doc)
                ids.append(2)
            return ids

        train_ids = encode_stream(train_texts)
        held_ids = encode_stream(held_texts)
        rt = sp.decode(sp.encode(train_texts[0]))
        log(f"[encode] {len(train_ids)} training tokens ({train_bytes / len(train_ids):.2f} bytes/token), "
            f"{len(held_ids)} held-out tokens in {time.time() - t0:.1f}s; "
            f"round trip {'exact' if rt == train_texts[0] else 'NOT exact'}")
        del train_texts, held_texts, lines

        # ---- model
        S, B = args.seq_len, args.batch_size
        config = build_config(max(1024, S))
        model = LlamaForCausalLM(config).to(device)  # fp32 master weights
        n_params = sum(p.numel() for p in model.parameters())
        log(f"[model] LlamaForCausalLM {n_params:,} parameters ({n_params * 2 / 2**20:.2f} MiB in bf16), "
            f"attn {getattr(config, '_attn_implementation', None)}")

        train_stream = torch.tensor(train_ids, dtype=torch.long, device=device)
        held_stream = torch.tensor(held_ids, dtype=torch.long, device=device)
        n_train_tokens = len(train_ids)
        del train_ids, held_ids
        if n_train_tokens < S + 2:
            print("error: too little training text for one sequence", file=sys.stderr)
            return 2
        arangeS = torch.arange(S + 1, device=device)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(args.seed)

        def epoch_starts() -> torch.Tensor:
            # a fresh random phase each epoch, then the chunks in random order
            offset = int(torch.randint(0, S, (1,), generator=gen)) if n_train_tokens > 2 * S + 2 else 0
            n = (n_train_tokens - offset - 1) // S
            starts = offset + torch.arange(n) * S
            return starts[torch.randperm(n, generator=gen)]

        seqs_per_epoch = (n_train_tokens - 1) // S
        steps_per_epoch = max(1, seqs_per_epoch // B)
        cap_steps = max(1, int(args.max_epochs * steps_per_epoch))

        # ---- optimizer
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
        opt_kwargs = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        if use_cuda:
            opt_kwargs["fused"] = True
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            **opt_kwargs,
        )
        V = config.vocab_size

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_cuda):
                logits = model(input_ids=x, use_cache=False).logits
            return F.cross_entropy(logits.float().view(-1, V), y.reshape(-1))

        step_fn = torch.compile(loss_fn) if use_compile else loss_fn

        @torch.no_grad()
        def evaluate(max_seqs: int | None = None) -> tuple[float, int]:
            """Mean next-token NLL (nats) over the held-out stream, cut into seq_len windows."""
            model.eval()
            n = held_stream.numel()
            starts = list(range(0, n - 1, S))
            if max_seqs is not None:
                starts = starts[:max_seqs]
            total, count = 0.0, 0
            full = [s for s in starts if s + S + 1 <= n]
            tail = [s for s in starts if s + S + 1 > n]
            for i in range(0, len(full), 64):
                idx = torch.tensor(full[i:i + 64], device=device)[:, None] + arangeS
                chunk = held_stream[idx]
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_cuda):
                    logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
                total += F.cross_entropy(logits.float().reshape(-1, V), chunk[:, 1:].reshape(-1),
                                         reduction="sum").item()
                count += chunk[:, 1:].numel()
            for s in tail:
                chunk = held_stream[s:][None]
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_cuda):
                    logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
                total += F.cross_entropy(logits.float().reshape(-1, V), chunk[:, 1:].reshape(-1),
                                         reduction="sum").item()
                count += chunk.shape[1] - 1
            model.train()
            return total / max(1, count), count

        # ---- training loop
        budget_s = args.minutes * 60.0
        warmup = max(1, min(args.warmup_steps, cap_steps // 5 if cap_steps >= 10 else 1))
        total_steps = cap_steps  # replanned from the measured step time
        min_lr = args.lr * args.min_lr_ratio
        eval_every = args.eval_every  # 0: chosen at the first plan (~12 evals per run)
        log(f"[train] seq_len {S} batch {B} ({S * B} tokens/step), {steps_per_epoch} steps/epoch, "
            f"cap {cap_steps} steps ({args.max_epochs:g} epochs), budget {budget_s:.0f}s, warmup {warmup}, "
            f"peak lr {args.lr:g}, compile {use_compile}")

        def sync():
            if use_cuda:
                torch.cuda.synchronize()

        plan_history = []
        eval_time = 0.0  # seconds spent in periodic evals (after the measuring mark)
        n_evals = 0

        def plan(step: int, now: float) -> None:
            """Set total_steps so that the run ends inside the budget (at most cap_steps).

            The step time is the mean since the measuring mark (after compilation), periodic
            evals excluded; their measured cost is added back per step."""
            nonlocal total_steps, eval_every
            step_time = (now - t_mark - eval_time) / max(1, step - measure_from)
            if eval_every <= 0:
                eval_every = args.eval_every if args.eval_every > 0 else max(
                    10, min(cap_steps, step + int(budget_s / step_time)) // 12)
            per_step = step_time + (eval_time / n_evals / eval_every if n_evals else 0.0)
            remaining = budget_s - (now - t_train0) - 0.02 * budget_s
            by_budget = step + max(0, int(remaining / per_step))
            total_steps = max(step + 1, warmup + 1, min(cap_steps, by_budget))
            plan_history.append(dict(at_step=step, step_time_s=round(step_time, 5), by_budget=by_budget,
                                     total_steps=total_steps))
            log(f"[plan] step {step}: {step_time * 1000:.1f} ms/step -> {by_budget} steps fit the budget, "
                f"cap {cap_steps}; total_steps = {total_steps}")

        model.train()
        t_train0 = time.time()
        starts_iter: list[int] = []
        epoch_pos = 0
        step = 0
        tokens_seen = 0
        measure_from = 5 if not use_cuda else 10
        plan_at = measure_from + 20
        t_mark = None
        planned = False
        loss_acc = torch.zeros((), device=device)
        loss_n = 0
        last_train_loss = float("nan")
        evals = []
        stopped_early = False

        while step < total_steps:
            if epoch_pos + B > len(starts_iter):
                starts_iter = epoch_starts().tolist()
                epoch_pos = 0
            batch_starts = torch.tensor(starts_iter[epoch_pos:epoch_pos + B], device=device)
            epoch_pos += B
            chunk = train_stream[batch_starts[:, None] + arangeS]
            lr = lr_at(step, args.lr, min_lr, warmup, total_steps)
            for g in optimizer.param_groups:
                g["lr"] = lr
            if step == 0 and use_compile:
                try:
                    loss = step_fn(chunk[:, :-1], chunk[:, 1:])
                    loss.backward()
                except Exception as e:  # keep the run alive: compilation is an optimization only
                    log(f"[train] torch.compile failed ({type(e).__name__}: {str(e)[:300]}); running eagerly")
                    optimizer.zero_grad(set_to_none=True)
                    step_fn, use_compile = loss_fn, False
                    loss = step_fn(chunk[:, :-1], chunk[:, 1:])
                    loss.backward()
            else:
                loss = step_fn(chunk[:, :-1], chunk[:, 1:])
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += B * S
            loss_acc += loss.detach()
            loss_n += 1

            if step <= 2:
                sync()
                log(f"[train] step {step} done at {time.time() - t_train0:.1f}s"
                    + (" (includes compilation)" if use_compile and step == 1 else ""))
            if step == measure_from:
                sync()
                t_mark = time.time()
            if not planned and t_mark is not None and step >= measure_from + 3 and (
                    step >= plan_at or time.time() - t_train0 > 0.3 * budget_s):
                sync()
                plan(step, time.time())
                planned = True

            if step % 10 == 0 or step == total_steps:
                last_train_loss = (loss_acc / loss_n).item()
                loss_acc.zero_()
                loss_n = 0
                if step % 50 == 0 or step == total_steps:
                    el = time.time() - t_train0
                    log(f"[train] step {step}/{total_steps} loss {last_train_loss:.4f} lr {lr:.2e} "
                        f"epoch {tokens_seen / n_train_tokens:.2f} tokens {tokens_seen / 1e6:.1f}M "
                        f"{tokens_seen / max(el, 1e-9) / 1e3:.0f}k tok/s elapsed {el:.0f}s")
            if planned and step % eval_every == 0 and step < total_steps:
                sync()
                te = time.time()
                hl, _ = evaluate(max_seqs=128)
                eval_time += time.time() - te
                n_evals += 1
                evals.append(dict(step=step, tokens=tokens_seen, heldout_subset_loss=round(hl, 4)))
                log(f"[eval] step {step} held-out (first 128 windows) loss {hl:.4f} ppl {math.exp(hl):.2f} "
                    f"({time.time() - te:.2f}s)")
                plan(step, time.time())  # re-plan with the step time measured so far
            if time.time() - t_train0 > budget_s * 1.05 and step < total_steps:
                log(f"[train] over the time budget at step {step}; stopping")
                stopped_early = True
                break

        sync()
        train_time = time.time() - t_train0
        if loss_n:
            last_train_loss = (loss_acc / loss_n).item()
        log(f"[train] done: {step} steps, {tokens_seen / 1e6:.1f}M tokens in {train_time:.1f}s")

        # ---- final held-out eval (all held-out tokens)
        t0 = time.time()
        held_loss, held_count = evaluate()
        held_ppl = math.exp(held_loss)
        log(f"[eval] final held-out loss {held_loss:.4f} nats/token, ppl {held_ppl:.3f} over {held_count} tokens "
            f"({time.time() - t0:.1f}s)")

        # ---- save (bf16) to a temp dir, then move files in one by one
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp_out = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            model.to(torch.bfloat16)
            kw = {}
            if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
                kw["safe_serialization"] = True
            model.save_pretrained(tmp_out, **kw)
            if not (tmp_out / "model.safetensors").exists():
                raise RuntimeError(f"save_pretrained wrote no model.safetensors: {sorted(os.listdir(tmp_out))}")
            shutil.copyfile(spm_path, tmp_out / "tokenizer.model")
            recipe = dict(
                description="Redline demo checkpoint: a tiny Llama (GQA, tied embeddings) trained on the "
                            "Python standard library source; made by scripts/train_demo_model.py",
                command=["scripts/train_demo_model.py"] + (list(argv) if argv is not None else sys.argv[1:]),
                args=vars(args),
                model=dict(architecture="LlamaForCausalLM", config=json.loads(config.to_json_string()),
                           parameters=n_params, saved_dtype="bfloat16"),
                tokenizer=dict(library="sentencepiece", file="tokenizer.model",
                               settings={k: v for k, v in sp_settings.items() if k != "num_threads"},
                               trained_on="training files only (a random sample of their non-empty lines)",
                               lines=spm_lines_used, chars=spm_chars_used),
                data=dict(source="python stdlib *.py (excluding site-packages, dist-packages, test/tests dirs"
                                 + ("" if args.include_idlelib else ", idlelib") + ")",
                          python_version=platform.python_version(), stdlib_dir=str(root),
                          document_format="BOS + file + EOS, concatenated, cut into seq_len windows",
                          heldout_rule=f"sha1(relative posix path) first 8 bytes big-endian % "
                                       f"{HELDOUT_BUCKETS} < {HELDOUT_PER_MILLE}",
                          train_files=len(train_rels), train_bytes=train_bytes, train_tokens=n_train_tokens,
                          heldout_files_count=len(held_rels), heldout_bytes=held_bytes,
                          heldout_tokens=int(held_stream.numel()), heldout_files=held_rels),
                training=dict(seq_len=S, batch_size=B, tokens_per_step=S * B, steps=step,
                              tokens_seen=tokens_seen, epochs=round(tokens_seen / n_train_tokens, 3),
                              optimizer=dict(name="AdamW", betas=[0.9, 0.95], eps=1e-8,
                                             weight_decay=args.weight_decay, grad_clip=1.0,
                                             master_weights="fp32"),
                              precision="bf16 autocast" if use_cuda else "fp32 (cpu)",
                              lr_schedule=dict(kind="linear warm-up then cosine decay", peak_lr=args.lr,
                                               min_lr=min_lr, warmup_steps=warmup, total_steps=total_steps),
                              planning=plan_history, stopped_early=stopped_early,
                              compiled=use_compile, wall_time_s=round(train_time, 1),
                              final_train_loss=round(last_train_loss, 4), evals=evals),
                results=dict(heldout_loss=round(held_loss, 5), heldout_ppl=round(held_ppl, 4),
                             heldout_tokens_scored=held_count, ppl_unit="per token"),
                environment=dict(torch=torch.__version__, transformers=transformers.__version__,
                                 sentencepiece=spm.__version__, python=platform.python_version(),
                                 device=device_name),
                total_wall_time_s=round(time.time() - t_start, 1),
            )
            atomic_write_text(tmp_out / "recipe.json", json.dumps(recipe, indent=2) + "\n")
            for name in sorted(os.listdir(tmp_out)):
                os.chmod(tmp_out / name, 0o644)
                os.replace(tmp_out / name, out_dir / name)
        finally:
            shutil.rmtree(tmp_out, ignore_errors=True)
        size = (out_dir / "model.safetensors").stat().st_size
        log(f"[save] {out_dir}: {sorted(os.listdir(out_dir))}; model.safetensors {size / 2**20:.2f} MiB; "
            f"total wall time {time.time() - t_start:.1f}s")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
