"""`--rope-scaling yarn:F` (dustin/models/args.py `with_rope_scaling`): the same model as a config.json edited for
YaRN, applied to target and draft, the documented Qwen2.5 setting enforced, bad specs refused with one line."""
from __future__ import annotations

import json
import shutil

import pytest

from dustin.errors import InputError
from dustin.models.args import named_config, with_rope_scaling
from dustin.models.loader import read_args


def test_equals_a_config_edited_for_yarn(tiny_pair, tmp_path):
    """What users did by hand (config.json with rope_scaling yarn and a 4x context) is what the flag gives."""
    target = tiny_pair[0]
    edited = tmp_path / "edited"
    shutil.copytree(target, edited)
    cfg = json.loads((edited / "config.json").read_text())
    orig = cfg["max_position_embeddings"]
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": orig}
    cfg.pop("rope_parameters", None)
    cfg["max_position_embeddings"] = 4 * orig
    (edited / "config.json").write_text(json.dumps(cfg))
    by_hand, by_flag = read_args(edited), read_args(target, "yarn:4")
    assert by_flag.max_position_embeddings == 4 * orig
    assert by_flag.rope_scaling["rope_type"] == "yarn" and by_flag.rope_scaling["factor"] == 4.0
    assert by_flag.rope_scaling["original_max_position_embeddings"] == orig
    from dustin.models.rope import rope_inv_freq

    (f1, a1), (f2, a2) = rope_inv_freq(by_hand), rope_inv_freq(by_flag)
    assert a1 == a2 and f1.tolist() == f2.tolist()
    assert read_args(target, None) == read_args(target)


def test_qwen25_takes_the_documented_factor_only():
    args = named_config("qwen2.5-1.5b")
    scaled = with_rope_scaling(args, "yarn:4")
    assert scaled.max_position_embeddings == 131072
    assert scaled.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(InputError, match="factor 4"):
        with_rope_scaling(args, "yarn:2")
    with pytest.raises(InputError, match="yarn:FACTOR"):
        with_rope_scaling(args, "linear:4")
    with pytest.raises(InputError, match="yarn:FACTOR"):
        with_rope_scaling(args, "yarn:1")
    with pytest.raises(InputError, match="already"):
        with_rope_scaling(named_config("llama-3.1-8b"), "yarn:4")  # its config scales RoPE (llama3) already


def test_engine_scales_both_models_and_admits_longer_prompts(tiny_pair):
    from dustin.engine.config import GenerationConfig
    from dustin.engine.engine import Engine

    target, draft = tiny_pair
    plain = Engine.from_pretrained(str(target), str(draft), dtype="fp32")
    long = Engine.from_pretrained(str(target), str(draft), dtype="fp32", rope_scaling="yarn:4")
    n = plain.pair.target.args.max_position_embeddings
    assert long.pair.target.args.max_position_embeddings == long.pair.draft.args.max_position_embeddings == 4 * n
    prompt = [5 + i % 80 for i in range(n + 100)]
    cfg = GenerationConfig(method="classic", gamma=2, max_new_tokens=4, stop_at_eos=False)
    with pytest.raises(InputError, match="model context"):
        plain.generate([prompt], cfg)
    assert len(long.generate([prompt], cfg).sequences[0].token_ids) == 4


def test_cli_refuses_a_bad_spec(tiny_pair, capsys):
    from dustin.cli.main import main

    code = main(["generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--rope-scaling", "yarn",
                 "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--rope-scaling" in err


def test_every_command_help_renders():
    """Each command's --help formats (a stray % in a help string breaks argparse's formatting at --help time)."""
    from dustin.cli.main import main

    for argv in (["generate"], ["serve"], ["demo"], ["models", "fetch"], ["warmup"], ["bench", "e2e"],
                 ["bench", "serve"], ["bench", "decode"], ["bench", "attention"], ["eval", "tasks"],
                 ["eval", "needles"], ["eval", "fidelity"], ["eval", "arr-kl"], ["profile", "all"]):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        assert e.value.code == 0, argv
