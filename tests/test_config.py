"""params.yaml: every profile validates, overlays merge, every value is read typed and bounded, nothing is defaulted
silently, errors are one sentence naming field, value and fix."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_module
from fault_helpers import PARAMS, _one_sentence
from jagg_core.setup.config import ParamsError
from jagg_core.setup.params_io import load_params, parse_yaml


@pytest.mark.parametrize("profile", ["toy", "toy-full", "ci", "flux", "qwenimage", "sd3", "wan"])
def test_every_profile_of_the_repo_validates(profile):
    p = load_params(REPO / "params.yaml", profile)
    assert p.profile == profile
    for m in p.run.methods:
        assert p.method(m).window >= 2


def test_paper_profiles_use_the_papers_settings():
    """The paper's grid: DanceGRPO on Flux and Qwen-Image (W = 4, first 60% of groups), Flow-GRPO-Fast on Flux (its
    3-step window is one JAGG group, with the ablation) and Qwen-Image (one group of 4); SD3."""
    grid = {"flux": ("dance_grpo", 4, 0.6), "qwenimage-dance": ("dance_grpo", 4, 0.6),
            "flux-fast": ("flow_grpo_fast", 3, 1.0), "qwenimage": ("flow_grpo_fast", 4, 1.0),
            "sd3": ("flow_grpo_fast", 4, 0.6)}
    for name, (recipe, window, frac) in grid.items():
        p = load_params(REPO / "params.yaml", name)
        assert (p.sample.recipe, p.jagg.window, p.jagg.jagg_frac) == (recipe, window, frac), name
        assert p.reward.weights == {"hpsv2.1": 1.0, "clipscore": 1.0}
        assert set(p.eval.metrics) == {"hpsv2.1", "pickscore", "clipscore"}
        if recipe == "flow_grpo_fast":
            assert p.sample.sde_window_size == window  # the window is one JAGG group
    flux = load_params(REPO / "params.yaml", "flux")
    assert flux.model.options["shift"] == 3.0 and not flux.train.global_std  # DanceGRPO: fixed shift, use_group
    assert "ablate" in load_params(REPO / "params.yaml", "flux-fast").run.methods


def test_the_wan_profile_is_pref_grpos_wan_recipe():
    """Pref-GRPO's scripts/finetune_prefgrpo_wan_2_1.sh (49 frames at 512 px): 50 steps, eta 0.7 with Flow-GRPO's SDE,
    8 clips per prompt, 60% of the steps, clip 1e-4, lr 6e-6, no KL, CFG 5, shift 3; the rewards on 8 frames."""
    p = load_params(REPO / "params.yaml", "wan")
    o = p.model.options
    assert (p.model.backbone, o["height"], o["width"], o["num_frames"], o["guidance_scale"], o["shift"]) == (
        "wan", 512, 512, 49, 5.0, 3.0)
    s, t = p.sample, p.train
    assert (s.num_steps, s.noise_level, s.sde_kind, s.recipe, s.timestep_fraction, s.group_size) == (
        50, 0.7, "flow_grpo", "dance_grpo", 0.6, 8)
    assert (t.clip_range, t.lr, t.beta, t.global_std, p.model.lora.rank) == (1e-4, 6e-6, 0.0, False, 0)
    assert (p.jagg.window, p.jagg.jagg_frac, p.reward.frames) == (4, "auto", 8)


@pytest.mark.parametrize("frames, ok", [("first", True), (3, True), ([0, -1], True), (0, False), ("middle", False)])
def test_reward_frames_validates(frames, ok):
    if ok:
        assert load_params(REPO / "params.yaml", "ci", {"reward.frames": frames}).reward.frames == frames
    else:
        with pytest.raises(ParamsError, match="reward.frames"):
            load_params(REPO / "params.yaml", "ci", {"reward.frames": frames})


def test_the_built_in_plugins_are_registered_through_the_entry_points():
    """jagg finds its own backbones and rewards the way it finds a user's: the `jagg.plugins` entry points."""
    from jagg_core.policies import available_backbones
    from jagg_core.rewards import available_rewards

    assert available_backbones() == ["flux", "qwenimage", "sd3", "toy-flux", "wan"]
    assert available_rewards() == ["clipscore", "hpsv2.1", "jpeg_compressibility", "pickscore", "served", "toy_background",
                                   "toy_fidelity", "toy_fidelity_rank", "toy_objects", "toy_precision", "toy_preference"]


def test_overlays_merge_deeply_and_overrides_win(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("train: {lr: 0.1, iterations: 3}\nprofiles:\n  fast: {train: {iterations: 1}}\n")
    p = load_params(f, "fast", {"train.lr": 0.5})
    assert (p.train.lr, p.train.iterations, p.profile) == (0.5, 1, "fast")
    assert load_params(f).train.iterations == 3


def test_method_overrides_apply_only_to_their_method():
    p = load_params(REPO / "params.yaml", "toy", {"methods.jagg.window": 8})
    assert p.method("jagg").window == 8 and p.method("ablate").window == p.jagg.window == 4
    assert p.method("jagg-reuse").reuse_rollout_velocity and not p.method("jagg").reuse_rollout_velocity
    with pytest.raises(ParamsError, match="unknown method 'x'"):
        p.method("x")


@pytest.mark.parametrize(
    "yaml_text,message",
    [
        ("train: {lr: abc}", "params.yaml (profile toy): train.lr = 'abc' is invalid: Input should be a valid number"),
        ("train: {lrr: 1}", "params.yaml (profile toy): unknown key 'train.lrr'; valid keys there: iterations, lr,"),
        ("jagg: {window: 1}", "jagg.window = 1 is invalid: Input should be greater than or equal to 2."),
        ("jagg: {jagg_frac: 2}", "jagg.jagg_frac = 2 is invalid: jagg_frac must be a number in [0, 1] or 'auto'."),
        ("jagg: {jagg_frac: autos}", "jagg_frac must be a number in [0, 1] or 'auto'"),
        ("model: {backbone: sdxl}", "unknown backbone; use one of flux, qwenimage, sd3, toy-flux, wan."),
        ("reward: {weights: {hps: 1}}", "unknown reward 'hps'; use one of clipscore, hpsv2.1"),
        ("[1, 2", "params.yaml is not valid YAML"),
        ("- 1\n- 2\n", "params.yaml must be a mapping of sections"),
        ("sample: {recipe: flow_grpo_fast, num_steps: 4, sde_window_size: 4, sde_window_range: [0, 3]}",
         "does not fit in num_steps 4"),
        ("sample: {recipe: mix_grpo, num_steps: 12, sde_window_size: 4, sde_window_range: [0, 10]}",
         "does not fit in num_steps 12"),
        ("sample: {recipe: mix_grpo, window_shift_every: 0}", "window_shift_every"),
    ],
)
def test_invalid_values_are_one_sentence(tmp_path, yaml_text, message):
    f = tmp_path / "params.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ParamsError) as e:
        load_params(f)
    text = str(e.value)
    assert message in text and text.count("\n") == 0 and text.endswith(".")


def test_missing_file_and_unknown_profile(tmp_path):
    with pytest.raises(ParamsError, match="does not exist"):
        load_params(tmp_path / "nope.yaml")
    f = tmp_path / "params.yaml"
    f.write_text("profiles: {a: {}}\n")
    with pytest.raises(ParamsError, match=f"unknown profile 'b'; profiles in {re.escape(str(f))}: a."):
        load_params(f, "b")


def test_every_param_key_dvc_yaml_names_exists_in_params_yaml():
    """`dvc repro` refuses a stage whose params key is missing, so each key every profile's pipeline lists (the root's
    dvc.yaml, the active profile's, or its pipelines/<profile>/dvc.yaml) must be in params.yaml."""
    import yaml

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    missing = []
    pipelines = [REPO / "dvc.yaml", *sorted((REPO / "pipelines").glob("*/dvc.yaml"))]  # the root's: the active one
    assert pipelines[1:]
    for name, stage in ((f"{p.parent.name}:{n}", s) for p in pipelines
                        for n, s in yaml.safe_load(p.read_text())["stages"].items()):
        for key in stage.get("params", []):
            cur = params
            for part in key.replace("${item.method}", "jagg").split("."):
                if not (isinstance(cur, dict) and part in cur):
                    missing.append(f"{name}: {key}")
                    break
                cur = cur[part]
    assert not missing


@pytest.mark.parametrize("override, fragment", [
    ({"train.lr": float("inf")}, "train.lr"),
    ({"train.max_grad_norm": float("inf")}, "train.max_grad_norm"),
    ({"sample.noise_level": float("nan")}, "sample.noise_level"),
    ({"reward.weights": {"toy_fidelity": float("nan")}}, "reward.weights"),
    ({"reward.weights": {"toy_fidelity": 0.0}}, "non-zero weight"),
    ({"reward.weights": {}}, "non-zero weight"),
    ({"run.methods": ["jagg", "jagg"]}, "'jagg' twice"),
    ({"run.methods": []}, "at least one"),
    ({"run.seeds": [0, 0]}, "0 twice"),
    ({"resources.cuda_visible_devices": {"jag": "0"}}, "'jag'"),
    ({"resources.machine_rank": 1, "resources.num_machines": 2}, "machine_rank differs per machine"),
    ({"train.iterations": "5"}, "whole number"),
    ({"train.iterations": True}, "not true/false"),
    ({"train.lr": True}, "not true/false"),
    ({"train.adam_betas": [1.5, -1]}, "betas"),
    ({"train.kl_ref_every": 0}, "train.kl_ref_every = 0"),
    ({"tracking.experiment": "x-{bogus}"}, "{profile}"),
    ({"resources.dispatch": "cluster"}, "'in-process' or 'pool'"),
    # a pool's workers on several hosts would each read a store of their own (docs/scaling.md)
    ({"resources.dispatch": "pool"}, "needs tracking.mlflow_uri to be an MLflow server"),
    ({"resources.dispatch": "pool", "tracking.mlflow_uri": "file:///srv/mlruns"}, "a file each host would read"),
    ({"resources.dispatch": "pool", "tracking.mlflow_uri": "/srv/mlruns"}, "a file each host would read"),
    ({"resources.dispatch": "pool", "tracking.mlflow_uri": "http://head:5000", "resources.num_machines": 2},
     "started on each machine by hand"),
])
def test_bad_values_are_one_sentence_before_any_work(override, fragment):
    with pytest.raises(ParamsError) as e:
        load_params(REPO / "params.yaml", "toy", override)
    msg = str(e.value)
    assert fragment in msg and "\n" not in msg, msg


@pytest.mark.parametrize("uri", ["http://head:5000", "https://user:pw@mlflow.lab/", "postgresql://db/mlflow",
                                 "databricks"])
def test_pool_dispatch_takes_a_tracking_store_every_host_reaches(uri):
    params = load_params(REPO / "params.yaml", "ci", {"resources.dispatch": "pool", "tracking.mlflow_uri": uri})
    assert params.resources.dispatch == "pool"
    assert load_params(REPO / "params.yaml", "ci").resources.dispatch == "in-process"  # the default


def test_a_yaml_float_without_a_dot_still_reads():
    assert load_params(REPO / "params.yaml", "toy", {"train.lr": "3e-4"}).train.lr == pytest.approx(3e-4)


def test_duplicate_yaml_keys_and_unsafe_profile_names_are_refused(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("train:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ParamsError, match="appears twice"):
        load_params(f)
    with pytest.raises(ParamsError, match="profile name"):
        load_params(REPO / "params.yaml", "../etc")


def test_parallel_runs_must_be_positive(capsys):
    from flows.run import main

    assert main(["--parallel-runs", "0"]) == 1
    assert "--parallel-runs 0 must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("stage, args", [("tasks.train", ["--method", "jagg"]), ("tasks.evaluate", ["--run", "base"])])
def test_an_unknown_reward_option_is_one_sentence_before_any_model_loads(ci_project, stage, args):
    from conftest import run_module

    before = sorted(p.relative_to(ci_project) for p in ci_project.rglob("*"))
    out = run_module(stage, "--profile", "ci", *args, "--set", "reward.options={toy_fidelity: {bogus: 1}}",
                     root=ci_project, timeout=120)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("jagg: error: ") and "reward.options.toy_fidelity: 'toy_fidelity' has no option 'bogus'" in lines[0]
    assert sorted(p.relative_to(ci_project) for p in ci_project.rglob("*")) == before  # nothing written


def test_a_missing_train_prompt_file_names_the_param_not_the_prepare_stage(tmp_path):
    import shutil

    from conftest import run_module

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    out = run_module("tasks.prepare", "--profile", "sd3", "--set", "data.train_prompts=nowhere/train.txt",
                     root=tmp_path, timeout=120)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-2000:]
    assert "data.train_prompts = nowhere/train.txt does not exist" in lines[0] and "prepare stage" not in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


@pytest.mark.parametrize("profile, global_std", [
    ("flux", False), ("qwenimage-dance", False),  # DanceGRPO --use_group: each prompt group's own std
    ("flux-fast", False),  # Flow-GRPO pickscore_flux_fast: global_std False
    ("qwenimage", True),  # Flow-GRPO pickscore_qwenimage: group means, the batch's std (global_std True)
    ("sd3", False),
])
def test_the_real_recipes_normalise_advantages_as_published(profile, global_std):
    """The toy's batch-std choice does not leak into the published recipes: each has its source's setting."""
    from jagg_core.setup.params_io import load_params

    assert load_params(REPO / "params.yaml", profile).train.global_std is global_std
    assert load_params(REPO / "params.yaml", "toy").train.global_std is True


def test_device_cuda_without_a_visible_gpu_is_one_sentence(monkeypatch):
    import torch

    from jagg_core.build import pick_device
    from jagg_core.setup.config import ParamsError
    from jagg_core.setup.params_io import load_params

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's case, also on a GPU runner
    with pytest.raises(ParamsError, match=r"^resources.device is 'cuda' but no CUDA device is visible; set it to"):
        pick_device(load_params(REPO / "params.yaml", "ci", {"resources.device": "cuda"}))
    assert pick_device(load_params(REPO / "params.yaml", "ci", {"resources.device": "auto"})).type == "cpu"


def test_mix_grpo_window_slides_and_rolls_back():
    """MixGRPO's progressive window: a stride every `window_shift_every` iterations, back to the start past the end."""
    import torch

    from jagg_core.setup.config import SampleConfig
    from jagg_core.trainer.rollout import choose_train_steps

    cfg = SampleConfig(recipe="mix_grpo", num_steps=12, sde_window_size=4, sde_window_range=(0, 9),
                       window_shift_every=3, window_stride=2)
    starts = [choose_train_steps(cfg, torch.Generator(), it)[0] for it in range(18)]
    assert starts == [0] * 3 + [2] * 3 + [4] * 3 + [6] * 3 + [8] * 3 + [0] * 3
    assert choose_train_steps(cfg, torch.Generator(), 7) == [4, 5, 6, 7]


@pytest.mark.parametrize("name", ["../../escaped", "/srv/elsewhere"])
def test_a_profile_name_set_by_override_cannot_escape_the_output_tree(tmp_path, name):
    """The pattern is on ``Params.profile`` itself: ``--set profile=…`` is refused like ``--profile …``, exit 1, one
    sentence, nothing written (it used to write ``../escaped/prompts``)."""
    from conftest import run_module

    root = tmp_path / "deep" / "project"
    root.mkdir(parents=True)
    (root / "params.yaml").write_text((REPO / "params.yaml").read_text())
    out = run_module("tasks.prepare", "--profile", "ci", "--set", f"profile={name}", root=root, timeout=120)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1 and len(lines) == 1 and "profile" in lines[0], out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["deep", "params.yaml", "project"]  # nothing written
    assert not Path("/srv/elsewhere").exists()


@pytest.mark.parametrize("override, field", [
    ({"model.options.guidance_scale": float("nan")}, "model.options.guidance_scale"),
    ({"reward.options": {"toy_fidelity": {"scale": float("inf")}}}, "reward.options.toy_fidelity.scale"),
    ({"model.options": {"grid": [1.0, float("-inf")]}}, "model.options.grid.1"),
])
def test_non_finite_numbers_inside_free_form_dicts_are_refused(override, field):
    with pytest.raises(ParamsError) as e:
        load_params(REPO / "params.yaml", "ci", override)
    assert field in str(e.value) and "finite" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_nan_guidance_scale_is_refused_by_evaluate_before_any_work(ci_project):
    from conftest import run_module

    before = sorted(p.relative_to(ci_project) for p in ci_project.rglob("*"))
    out = run_module("tasks.evaluate", "--profile", "ci", "--run", "base", "--set", "model.options.guidance_scale=.nan",
                     root=ci_project, timeout=120)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-2000:]
    assert "model.options.guidance_scale" in lines[0] and "finite" in lines[0]
    assert sorted(p.relative_to(ci_project) for p in ci_project.rglob("*")) == before


def test_unreadable_params_files_are_one_sentence(tmp_path):
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(tmp_path / "loop2.yaml")
    (tmp_path / "loop2.yaml").symlink_to(loop)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("train: {lr: 0.1}  # caf\xe9\n".encode("latin-1"))
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text("a: &a [x, x, x, x, x, x, x, x, x, x]\n"
                      + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi")))
    selfref = tmp_path / "selfref.yaml"
    selfref.write_text("model: {options: {x: &m [1, *m]}}\n")  # a list that holds itself
    for f, fragment in [(folder, "is a folder"), (loop, "cannot be read"), (latin, "not UTF-8"),
                        (laughs, "expands to more than"), (selfref, "refers to itself")]:
        with pytest.raises(ParamsError, match=fragment) as e:
            load_params(f)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("value, fragment", [
    ("train.lr=[1", "not valid YAML"),
    ("train.lr=*a", "not valid YAML"),
    ("train.lr=!!python/object:os.system {}", "not valid YAML"),
    ("train.lr={a: 1, a: 2}", "appears twice"),
])
def test_invalid_yaml_in_set_values_is_one_sentence(capsys, value, fragment):
    from tasks.prepare import main

    assert main(["--profile", "ci", "--set", value]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jagg: error: --set train.lr") and fragment in err and err.count("\n") == 1, err


def test_every_prefect_deployment_names_a_profile_that_validates():
    """`jagg services up` deploys prefect.yaml --all: every deployment's profile (wan included) loads."""
    import yaml

    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    # (a pool-dispatched sweep's units, flows/pool.py, take their profile from the sweep that submits them)
    profiles = {d["name"]: d["parameters"]["profile"] for d in deployments if "parameters" in d}
    assert profiles["wan"] == "wan"
    for profile in set(profiles.values()):
        assert load_params(REPO / "params.yaml", profile).profile == profile


# --- one typed, bounded reading of every value; no silent defaults -------------------------------------------------


@pytest.mark.parametrize("overrides, says", [
    # 1: an anchored string counts by its size, each time an alias copies it
    ({"model.options": yaml.safe_load("{big: &s '" + "x" * 20_000 + "', l1: &l1 [" + ", ".join(["*s"] * 100) +
                                      "], l2: [" + ", ".join(["*l1"] * 100) + "]}")}, "expands to more than"),
    # 2 (regression): numbers written as strings are read as numbers, and must be finite
    ({"model.options.guidance_scale": "1e400"}, "model.options.guidance_scale = '1e400'"),
    ({"model.options.guidance_scale": "nan"}, "finite number"),
    ({"reward.options.toy_fidelity.tau": "-inf"}, "finite number"),
    # 4: option values are typed, against what the backbone / reward takes
    ({"model.options.guidance_scale": "abc"}, "model.options.guidance_scale = 'abc' is invalid"),
    ({"model.options.guidance_scale": [3]}, "model.options.guidance_scale"),
    ({"model.options.height": 64}, "'toy-flux' has no option 'height'"),
    ({"reward.options.toy_fidelity.tau": "abc"}, "reward.options.toy_fidelity.tau = 'abc'"),
    ({"reward.options.toy_fidelity.tau": [100]}, "reward.options.toy_fidelity.tau = [100]"),
    ({"reward.options.toy_fidelity.tau": True}, "reward.options.toy_fidelity.tau"),
    ({"reward.options.jpeg_compressibility.quality": 9.5}, "reward.options.jpeg_compressibility.quality"),
    ({"reward.options.toy_preference.sigma": -1}, "reward.options.toy_preference.sigma"),
    ({"reward.options.toy_fidelity": [1]}, "reward.options.toy_fidelity"),
    ({"model.options.lora": {"rank": "abc"}}, "model.options.lora.rank = 'abc'"),  # a dict inside the options
    ({"reward.weights": {"toy_fidelity": "nan"}}, "finite number"),
    # 6: seeds are not negative
    ({"run.seeds": [-1]}, "run.seeds.0 = -1"),
    ({"world.seed": -1}, "world.seed = -1"),
    ({"eval.seed": -3}, "eval.seed = -3"),
    ({"pretrain.seed": -1}, "pretrain.seed = -1"),
    # 12: a format spec in the experiment name would allocate 100 GB to validate it
    ({"tracking.experiment": "{profile:>99999999999}"}, "without a format spec"),
    ({"tracking.experiment": "x-{profile!r}"}, "without a format spec"),
    ({"tracking.experiment": "a\nb"}, "printable"),
    # 14: names the pattern allowed but MLflow or the file system refuse
    ({"methods": {"jagg\n": {"mode": "jagg"}}, "run.methods": ["jagg\n"]}, "method name 'jagg\\n'"),
    ({"methods": {"m" * 300: {"mode": "jagg"}}, "run.methods": ["m" * 300]}, "at most 64"),
    ({"outputs": "o" * 300}, "outputs ="),
    ({"outputs": "a\n"}, "outputs ="),
    # 18: sizes bounded before anything is allocated
    ({"sample.group_size": 100_000_000}, "sample.group_size"),
    ({"sample.group_size": "1e8"}, "sample.group_size"),
    ({"sample.prompts_per_iteration": 10 ** 9}, "sample.prompts_per_iteration"),
    ({"world.n_train": 10 ** 12}, "world.n_train"),
    ({"sample.sde_window_range": [0, 10 ** 30]}, "sample.sde_window_range"),
])
def test_every_value_is_read_typed_and_bounded(overrides, says):
    with pytest.raises(ParamsError) as e:
        load_params(PARAMS, "ci", overrides)
    assert says in _one_sentence(e.value), e.value


def test_an_anchored_string_bomb_in_a_params_file_is_refused(tmp_path):
    """Item 1 as reported: the bomb in the params file itself (10 MB × 1000 × 500 to serialise before)."""
    bomb = ("options: {big: &s '" + "x" * 1_000_000 + "', l1: &l1 [" + ", ".join(["*s"] * 1000) + "], l2: [" +
            ", ".join(["*l1"] * 500) + "]}")
    text = PARAMS.read_text().replace("options: {}", bomb, 1)  # model.options, the first of the file
    assert bomb in text
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ParamsError) as e:
        load_params(tmp_path / "params.yaml", "ci")
    assert "expands to more than" in _one_sentence(e.value)


def test_typed_options_keep_what_is_valid_and_read_numeric_strings_as_numbers():
    p = load_params(PARAMS, "ci", {"model.options.guidance_scale": "3e0", "reward.options.toy_fidelity.tau": "1e2"})
    assert p.model.options == {"guidance_scale": 3.0} and p.reward.options == {"toy_fidelity": {"tau": 100.0}}
    for profile in ("flux", "sd3", "qwenimage", "wan"):  # every shipped profile's options still read
        load_params(PARAMS, profile)


def test_option_schemas_agree_with_the_backbones_and_the_rewards():
    import inspect

    from jagg_core.setup.registry import backbone_names, backbone_spec, reward_names, reward_spec

    for backbone in backbone_names():
        spec = backbone_spec(backbone)
        if spec.defaults:  # a diffusers backbone: its schema is its DEFAULTS' keys
            assert set(spec.options) == set(spec.defaults), backbone
    assert set(backbone_spec("toy-flux").options) == {"lora", "guidance_scale"}  # policies/toy_flux.py:load_toy_flux
    for name in reward_names():
        spec = reward_spec(name)
        assert set(spec.options) == set(inspect.signature(spec.factory).parameters), name


@pytest.mark.parametrize("value, says", [
    ("9" * 5000, "--set x holds a value YAML cannot read"),  # 12 (regression): PyYAML's int of 5000 digits
    ("!!binary /w==", "--set x holds a"),  # 12: bytes that are not UTF-8
    ("!!binary aGVsbG8=", "bytes value"),  # bytes at all: not a param
    ("!!set {a, b}", "set value"),  # 4: YAML features a worker crashed on
    ("2001-12-14", "date value"),
    ("2001-12-14t21:59:43.10-05:00", "datetime value"),
    ("[&s '" + "y" * 600_000 + "', *s]", "expands to more than"),  # 1: an aliased string counts twice
])
def test_parse_level_values_are_one_sentence(value, says):
    with pytest.raises(ParamsError) as e:
        parse_yaml(value, "--set x")
    assert says in _one_sentence(e.value)


def test_a_long_set_value_is_refused_before_it_is_parsed():
    from tasks.common import parse_overrides

    with pytest.raises(ParamsError) as e:
        parse_overrides(["model.options.guidance_scale=" + "9" * 100_000])
    assert "characters long" in _one_sentence(e.value)


@pytest.mark.parametrize("kind", ["dev-zero", "dev-urandom", "fifo"])
def test_params_on_a_file_that_is_not_regular_is_refused_at_once(kind, tmp_path):
    path = {"dev-zero": Path("/dev/zero"), "dev-urandom": Path("/dev/urandom"), "fifo": tmp_path / "fifo"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert "not a regular file" in _one_sentence(e.value)


@pytest.mark.parametrize("text, profile, says", [
    ("profile: ci\n", None, "holds no sections"),
    ("", None, "is empty"),
    ("# nothing but a comment\n", None, "is empty"),
    (None, "", "--profile is empty"),
    (None, " ", "--profile is empty"),
])
def test_no_silent_defaults(text, profile, says, tmp_path):
    path = tmp_path / "params.yaml"
    if text is None:
        shutil.copy(PARAMS, path)
    else:
        path.write_text(text)
    with pytest.raises(ParamsError) as e:
        load_params(path, profile)
    assert says in _one_sentence(e.value)


@pytest.mark.parametrize("overrides, says", [
    ({"sample.group_size": 1024, "sample.prompts_per_iteration": 65536, "sample.batch_size": 65536},
     "images per iteration"),
    ({"sample.group_size": 512, "sample.prompts_per_iteration": 16, "sample.num_steps": 1000}, "stored latents"),
])
def test_c2_products_of_sizes_are_bounded_with_one_sentence(overrides, says):
    """Each size was bounded on its own (round 4), their product was not: 1024 × 65,536 images per iteration was an
    out-of-memory error in the worker, classed as a death and retried. Now one sentence at validation."""
    with pytest.raises(ParamsError, match=says) as e:
        load_params(PARAMS, "ci", overrides)
    _one_sentence(str(e.value))


@pytest.mark.parametrize("overrides, says", [
    ({"run.seeds": [True]}, "run.seeds.0"),
    ({"run.seeds": ["3"]}, "run.seeds.0"),
    ({"run.seeds": [3.0]}, "run.seeds.0"),
    ({"reward.weights": {"toy_fidelity": True}}, "reward.weights.toy_fidelity"),
    ({"train.adam_betas": [True, 0.999]}, "train.adam_betas.0"),
    ({"sample.sde_window_range": [False, True]}, "sample.sde_window_range.0"),
    ({"sample.sde_window_range": ["0", "1"]}, "sample.sde_window_range.0"),
    ({"model.options.lora": {"rank": True}}, "model.options.lora.rank"),
    ({"model.options.lora": {"rank": "8"}}, "model.options.lora.rank"),
    ({"model.options.lora": {"dropout": False}}, "model.options.lora.dropout"),
    ({"reward.frames": [True]}, "reward.frames"),
    ({"eval.metrics": []}, "eval.metrics"),
    ({"tracking.retries": 1_000_000}, "tracking.retries"),
])
def test_c6_bools_and_quoted_counts_are_refused_inside_lists_and_dicts(overrides, says):
    """Round 4's "true/false is not a number, "5" is not a count" held for top-level fields only: `run.seeds=[true]`
    trained seed 1, `["3"]` seed 3, `reward.weights={toy_fidelity: true}` weighed 1.0; `eval.metrics=[]` passed
    validation and failed once the MLflow run existed; `tracking.retries` had no upper bound. One sentence each."""
    with pytest.raises(ParamsError, match=says.replace(".", r"\.")) as e:
        load_params(PARAMS, "ci", overrides)
    _one_sentence(str(e.value))


def test_c6_valid_values_inside_lists_and_dicts_still_read():
    """What was valid stays valid: YAML 1.1's exponents that it reads as strings (3e-4) for numbers, ints for
    numbers (a quoted "0.99" no longer: issue 71, one strictness)."""
    p = load_params(PARAMS, "ci", {"run.seeds": [0, 7], "reward.weights": {"toy_fidelity": 1, "toy_preference": "5e-1"},
                                   "train.adam_betas": [0.9, "99e-2"], "sample.sde_window_range": [0, 1],
                                   "model.options.lora": {"rank": 4, "alpha": 8}, "tracking.retries": 20})
    assert p.run.seeds == [0, 7] and p.reward.weights == {"toy_fidelity": 1.0, "toy_preference": 0.5}
    assert p.train.adam_betas == (0.9, 0.99) and p.model.options["lora"]["rank"] == 4


def test_c6_yaml_merge_keys_are_read_in_a_file_and_in_set(tmp_path):
    """`<<: *base` and `<<: [*a, *b]` are YAML that `yaml.safe_load` reads; the duplicate-key loader refused them as
    "not valid YAML". A key written beside the merge overrides the merged one; a key written twice is still refused."""
    from tasks.common import parse_overrides

    f = tmp_path / "params.yaml"
    f.write_text(PARAMS.read_text().replace(
        "  ci:\n", "  merged:\n    world: &w {seed: 3}\n    pretrain: {<<: *w, steps: 40}\n"
        "    train: {<<: [{iterations: 3}, {lr: 0.0002}], micro_batch: 8}\n  ci:\n", 1))
    p = load_params(f, "merged")
    assert p.pretrain.seed == 3 and p.pretrain.steps == 40
    assert p.train.iterations == 3 and p.train.lr == 0.0002 and p.train.micro_batch == 8
    sets = parse_overrides(["train={<<: {iterations: 5, lr: 0.001}, lr: 0.002}"])
    assert sets == {"train": {"iterations": 5, "lr": 0.002}}
    with pytest.raises(ParamsError, match="appears twice"):
        parse_overrides(["train={<<: {iterations: 5}, lr: 0.1, lr: 0.2}"])


def test_c3_an_empty_profile_overlay_with_no_sections_is_refused(tmp_path):
    """A params file holding `profile: ci` and `profiles: {ci: {}}` passed round 4's check (`profile: ci` alone) and
    prepare overwrote data/ci/prompts with the code's sizes; what was there is kept."""
    root = tmp_path / "project"
    (root / "data" / "ci" / "prompts").mkdir(parents=True)
    kept = root / "data" / "ci" / "prompts" / "train.jsonl"
    kept.write_text('{"prompt": "kept"}\n')
    (root / "params.yaml").write_text("profile: ci\nprofiles: {ci: {}}\n")
    out = run_module("tasks.prepare", root=root, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "every value would be the code's default" in _one_sentence(out.stderr.removeprefix("jagg: error: "))
    assert kept.read_text() == '{"prompt": "kept"}\n'
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == [
        "data/ci/prompts/train.jsonl", "params.yaml"]


def test_m6_a_key_path_1200_deep_is_one_sentence(tmp_path):
    """`--set a.a.…(1200 parts)=1` was a RecursionError traceback (validation recursed through the nested tree)."""
    deep = ".".join(["a"] * 1200)
    with pytest.raises(ParamsError, match="1,200 levels deep"):
        load_params(PARAMS, "ci", {deep: 1})
    out = run_module("tasks.plan", "--profile", "ci", "--params", str(PARAMS), "--set", f"{deep}=1", root=tmp_path)
    assert out.returncode == 1 and _one_sentence(out.stderr).startswith("jagg: error: override a.a."), out.stderr


# --- one strictness for every typed field (jagg_core/setup/options.py:coercion_problem) ------------------------------


def _typed_models():
    """Every params section (walked from Params) and every registered plugin's option reader."""
    from pydantic import BaseModel

    from jagg_core.setup import registry
    from jagg_core.setup.config import Params
    from jagg_core.setup.options import Section

    load_params(PARAMS, "ci")  # the plugins loaded
    seen, todo = {}, [Params]
    while todo:
        model = todo.pop()
        if model.__name__ in seen:
            continue
        seen[model.__name__] = model
        for field in model.model_fields.values():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                todo.append(field.annotation)
    for kind, names in (("backbone", registry.backbone_names()), ("reward", registry.reward_names())):
        for name in names:
            spec = registry.backbone_spec(name) if kind == "backbone" else registry.reward_spec(name)
            seen[f"{kind} {name}"] = registry._reader(f"{kind}-options", spec)
    assert all(issubclass(m, Section) for m in seen.values())
    return seen


def test_every_flag_count_and_number_of_every_section_and_plugin_is_read_with_one_strictness():
    """`reward.options.served.max_in_flight: "8"` was refused while `timeout_s: "60"`, `overlap: "no"`, `overlap: 1`
    and `max_in_flight: 8.0` were read (pydantic's lax mode). Now every field of every section and every plugin's
    options is held to one rule: a flag takes true/false only, a count a whole number as written, a number no quoted
    string (but YAML 1.1's 3e-4, which it reads as a string)."""
    from types import UnionType
    from typing import Annotated, Union, get_args, get_origin

    from pydantic import ValidationError

    def _scalar_types(annotation) -> set:  # Annotated and Optional unwrapped
        if get_origin(annotation) is Annotated:
            return _scalar_types(get_args(annotation)[0])
        if get_origin(annotation) in (Union, UnionType):
            return set().union(*(_scalar_types(a) for a in get_args(annotation)))
        return {annotation}

    wrong = {frozenset({bool}): ["no", 1, 0.0], frozenset({int}): ["8", 8.0, True], frozenset({float}): ["60", True]}
    checked = 0
    for where, model in _typed_models().items():
        for name, field in model.model_fields.items():
            types = frozenset(_scalar_types(field.annotation) - {type(None)})
            for value in wrong.get(types, []):
                with pytest.raises(ValidationError, match=f"{name} = {value!r} must be"):
                    model.model_validate({name: value})
                checked += 1
    assert checked > 250, checked  # every section's and plugin's flags (131 fields), counts and numbers
    for value, options in (("6e1", {"timeout_s": 60.0}), (60, {"timeout_s": 60.0})):
        assert load_params(PARAMS, "ci", {"reward.options.served.timeout_s": value}).reward.options["served"] == options
    for key, value in (("timeout_s", "60"), ("overlap", "no"), ("overlap", 1), ("max_in_flight", 8.0),
                       ("max_in_flight", "8")):
        with pytest.raises(ParamsError, match=rf"reward\.options\.served\.{key} = {value!r} must be"):
            load_params(PARAMS, "ci", {f"reward.options.served.{key}": value})
