"""The same task with TRL's GRPOTrainer: a tiny Llama built from a local config, a word-level
tokenizer built in place, the verifiable reward as a TRL reward function, a few steps on CPU.

The point is the mapping: each GRPOConfig field below is a Config field of train.py (group size,
clip range, KL weight, inner steps, learning rate), and TRL's loop is the hand-written one with
generation and training in one process (vLLM would take the generator's place on GPUs). The
reward rise is proven on the hand-written loop (train.py); here a handful of steps only show
that it runs, its reward is ours, and the weights move. One process (TRL's own launcher,
`accelerate launch`, spreads it over GPUs).

Run:
    python chapters/ch27_rlhf/trl_grpo.py               # 4 steps on CPU, under 10 s
    python chapters/ch27_rlhf/trl_grpo.py --steps 40    # longer: watch TRL's logged reward
"""

# launch: python   (./course run 27 trl_grpo starts this script with python, not torchrun)

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from chapters.ch27_rlhf import rl
from common.config import RunConfig, parse_config, require_at_least_one
from common.log import library_output, log, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything

SPECIALS = ["<pad>", "<eos>"]


@dataclass
class Config(RunConfig):
    steps: int = 4
    """GRPOTrainer optimizer steps."""
    prompts_per_step: int = 2
    """Prompts per step; each gets group_size completions."""
    group_size: int = 8
    """TRL's num_generations: completions per prompt (train.py's --group-size)."""
    lr: float = 3e-3
    """TRL's learning_rate (train.py's --lr)."""
    clip: float = 0.2
    """TRL's epsilon (train.py's --clip)."""
    beta: float = 0.02
    """TRL's beta, the KL weight (train.py's --beta; TRL's default is 0)."""
    inner_steps: int = 2
    """TRL's num_iterations (train.py's --inner-steps)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "prompts_per_step", "inner_steps")
        if self.group_size < 2:
            raise ValueError("GRPO needs --group-size of at least 2 (a group's std)")


def validate(cfg: Config, world_size: int) -> None:
    if world_size != 1:
        raise ValueError("trl_grpo.py runs as one process: start it with python (TRL spreads "
                         "itself over GPUs with accelerate launch, not this course's torchrun)")


def vocabulary() -> list[str]:
    return SPECIALS + [f"T{t}" for t in range(rl.MAX_TARGET + 1)] + [str(d) for d in range(10)]


def build_tokenizer():
    """A word-level tokenizer over the task's tokens, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def build_model(tokenizer):
    """A one-layer Llama of width 32 from a local config (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(vocabulary()), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id))


def digit_sum_reward(prompts, completions, **_) -> list[float]:
    """TRL reward function: the chapter's `rl.reward` on the three digits written; a completion
    that is not three digits earns 0."""
    out = []
    for prompt, text in zip(prompts, completions):
        words = text.split()
        if len(words) != 3 or not all(w.isdigit() for w in words):
            out.append(0.0)
            continue
        target = torch.tensor([int(prompt.strip()[1:])])
        out.append(rl.reward(target, torch.tensor([[int(w) for w in words]])).item())
    return out


def grpo_config(cfg: Config, out_dir: str):
    """train.py's knobs under TRL's names."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir, max_steps=cfg.steps, learning_rate=cfg.lr, seed=cfg.seed,
        per_device_train_batch_size=cfg.prompts_per_step * cfg.group_size,
        num_generations=cfg.group_size, max_completion_length=3, epsilon=cfg.clip,
        beta=cfg.beta, num_iterations=cfg.inner_steps, loss_type="grpo", scale_rewards="group",
        use_cpu=True, bf16=False, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0,
        # the hand decoder's action space: only the 10 digits may be sampled
        generation_kwargs={"suppress_tokens": list(range(len(SPECIALS) + rl.MAX_TARGET + 1))})


def main(cfg: Config) -> int:
    setup_logging()
    rec = RunRecorder(cfg, __file__)
    seed_everything(cfg.seed)
    log.info("TRL GRPOTrainer, one CPU process: %d steps of %d prompts x %d completions "
             "(importing trl takes a few seconds)", cfg.steps, cfg.prompts_per_step, cfg.group_size)
    with library_output():
        from datasets import Dataset
        from trl import GRPOTrainer

        tokenizer = build_tokenizer()
        model = build_model(tokenizer)
        before = [p.detach().clone() for p in model.parameters()]
        g = torch.Generator().manual_seed(cfg.seed)
        targets = torch.randint(0, rl.MAX_TARGET + 1, (cfg.steps * cfg.prompts_per_step * 4,), generator=g)
        data = Dataset.from_dict({"prompt": [f"T{int(t)}" for t in targets]})
        args = grpo_config(cfg, str(rec.out / "trl"))
        init = rec.out / "trl" / "init"  # TRL builds its frozen reference from a path (β > 0)
        model.save_pretrained(init)
        tokenizer.save_pretrained(init)
        trainer = GRPOTrainer(model=str(init), reward_funcs=digit_sum_reward, args=args,
                              train_dataset=data, processing_class=tokenizer)
        trainer.train()
        model = trainer.model
    logged = [h for h in trainer.state.log_history if "reward" in h]
    for h in logged:
        rec.metrics(int(h["step"]), loss=h.get("loss", 0.0), lr=h.get("learning_rate", cfg.lr),
                    reward=h["reward"])
    for ours, theirs in (("--group-size", "num_generations"), ("--clip", "epsilon"),
                         ("--beta", "beta"), ("--inner-steps", "num_iterations"),
                         ("--lr", "learning_rate")):
        rec.figure(f"GRPOConfig.{theirs} (train.py {ours})", getattr(args, theirs))
    rec.figure("TRL's logged mean reward, first / last step",
               f"{logged[0]['reward']:.3f} / {logged[-1]['reward']:.3f}")
    rec.check("optimizer steps TRL took == --steps", "count", trainer.state.global_step, cfg.steps)
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))
    rec.check("weights moved (max |Δθ|) > 0", "count", moved, 0.0, compare=">")
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
