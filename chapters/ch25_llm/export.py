"""The trained model out of FSDP2 and into Hugging Face format, and back: the full weights
gathered to rank 0, `save_pretrained`, `AutoModelForCausalLM.from_pretrained`."""

from __future__ import annotations

import torch


def other_rope_base(path):
    """The saved config with its RoPE base doubled: the weights still load without a word."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "rope_parameters", None):  # transformers 5
        config.rope_parameters = {**config.rope_parameters,
                                  "rope_theta": config.rope_parameters["rope_theta"] * 2}
    else:  # transformers 4
        config.rope_theta *= 2
    return config


def export_and_reload(model, config, out, probe, prompt, cfg, info) -> dict | None:
    """Gather the full weights (a collective), then on rank 0: a plain `LlamaForCausalLM` gets
    them, `save_pretrained` writes it, `AutoModelForCausalLM.from_pretrained` reads it back.
    Returns both models' logits on `probe`, greedy samples from both, and a control model
    loaded with a wrong RoPE base (same weights, silently different outputs)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not info.is_main:
        return None
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    trained = LlamaForCausalLM(config).float()
    trained.load_state_dict(full)
    trained.to(info.device).eval()  # the gpu preset's 300M model: on the GPU, not the CPU
    path = out / "hf_model"
    trained.save_pretrained(path)
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(info.device).eval()
    wrong = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 config=other_rope_base(path)).to(info.device).eval()
    probe, prompt = probe.to(info.device), prompt.to(info.device)
    with torch.no_grad():
        logits = {name: m(input_ids=probe, use_cache=False).logits
                  for name, m in (("trained", trained), ("reloaded", reloaded), ("wrong rope", wrong))}
        n = prompt.shape[1]
        gen = {name: m.generate(prompt, max_new_tokens=cfg.sample_tokens, do_sample=False,
                                pad_token_id=0)[0, n:]
               for name, m in (("trained", trained), ("reloaded", reloaded))}
        torch.manual_seed(cfg.seed)
        sample = trained.generate(prompt, max_new_tokens=cfg.sample_tokens, do_sample=True,
                                  top_k=40, temperature=0.8, pad_token_id=0)[0, n:]
    reloaded_params = {k: v.detach().cpu() for k, v in reloaded.named_parameters()}
    return {"logits": logits, "gen": {k: v.cpu() for k, v in gen.items()},
            "sample": sample.cpu(), "path": path, "reloaded_params": reloaded_params}
