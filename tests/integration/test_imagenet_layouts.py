"""ImageNet in the layouts people have (largebatch/data/imagefolder.py, docs/imagenet.md), on miniatures written in
those exact layouts (tests/imagenet_tree.py): ILSVRC2012/Kaggle's train/<wnid>/ and flat val/ with
LOC_val_solution.csv, or any label file given as data.val_labels; hidden folders ignored, nested folders and
PNGs read as torchvision's ImageFolder reads them; class names kept in the run directory; bad label files one
sentence."""
from __future__ import annotations

import json
import os

import pytest
import torch

from imagenet_tree import WNIDS, ilsvrc
from largebatch.config import DataConfig
from largebatch.data import build_data
from largebatch.data.imagefolder import scan
from largebatch.errors import UserError

pytestmark = pytest.mark.timeout(300)


def _cfg(root, **kw) -> DataConfig:
    return DataConfig(**{"dataset": "imagefolder", "root": str(root), "image_size": 24, "loader_workers": 0, **kw})


def test_the_kaggle_layout_reads_with_classes_in_torchvisions_order(tmp_path, capsys):
    root, wnids = ilsvrc(tmp_path)
    train, test, info = build_data(_cfg(root), seed=0)
    err = capsys.readouterr().err
    assert ".ipynb_checkpoints ignored (not classes)" in err and "LOC_val_solution.csv" in err
    assert info.classes == tuple(wnids) and info.num_classes == 3
    assert (len(train), len(test)) == (3 * 6 + 3, 3 * 2)   # the PNG, the CMYK file and the nested image count
    classes, paths, labels = scan(root, "train")
    names = [os.path.relpath(p, root / "train") for p in paths]
    assert names[:7] == [f"{WNIDS[0]}/{WNIDS[0]}_{i}.JPEG" for i in range(6)] + [f"{WNIDS[0]}/{WNIDS[0]}_png.JPEG"]
    assert names[-1] == f"{WNIDS[2]}/extra/{WNIDS[2]}_nested.JPEG"   # a class's own files, then its sub-folders
    assert labels.tolist() == [0] * 7 + [1] * 7 + [2] * 7
    x, y = next(train.batches([torch.arange(len(train))], train=True, epoch=0))
    assert len(y) == len(train) and not train.corrupt   # PNG and CMYK decode
    _, y = next(test.batches([torch.arange(6)], train=False, epoch=0))
    assert y.tolist() == [0, 0, 1, 1, 2, 2]


def test_any_label_file_names_the_flat_val_images(tmp_path):
    root, wnids = ilsvrc(tmp_path)
    (tmp_path / "LOC_val_solution.csv").unlink()
    with pytest.raises(UserError, match="flat folder of 6 images without class folders.*set data.val_labels"):
        build_data(_cfg(root), seed=0)
    labels = tmp_path / "val_labels.txt"
    labels.write_text("".join(f"ILSVRC2012_val_{n:08d}.JPEG {wnids[(n - 1) // 2]}\n" for n in range(1, 7)))
    _, test, _ = build_data(_cfg(root, val_labels=str(labels)), seed=0)
    _, y = next(test.batches([torch.arange(6)], train=False, epoch=0))
    assert y.tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("content, fragment", [
    ("ILSVRC2012_val_00000001 n01440764\n", "5 image(s) in"),                                  # images without a label
    ("".join(f"ILSVRC2012_val_{n:08d} n01440764\n" for n in range(1, 8)), "labels 1 image(s) that"),   # a missing image
    ("".join(f"ILSVRC2012_val_{n:08d} n99999999\n" for n in range(1, 7)), "names class(es) ['n99999999']"),
    ("ILSVRC2012_val_00000001\n", "line 1 ('ILSVRC2012_val_00000001') has no class"),
])
def test_a_bad_label_file_is_one_sentence(tmp_path, content, fragment):
    root, _ = ilsvrc(tmp_path)
    labels = tmp_path / "labels.txt"
    labels.write_text(content)
    with pytest.raises(UserError) as err:
        build_data(_cfg(root, val_labels=str(labels)), seed=0)
    assert fragment in str(err.value) and str(err.value).endswith(".")


def test_val_split_does_not_need_a_val_folder(tmp_path):
    root, _ = ilsvrc(tmp_path)
    os.rename(root / "val", tmp_path / "elsewhere")
    train, test, info = build_data(_cfg(root, val_split=3), seed=0)
    assert (len(train), len(test)) == (18, 3) and info.classes == tuple(WNIDS)


def test_a_run_keeps_its_class_names_and_counts_and_evaluate_refuses_shifted_labels(tmp_path, cli):
    root, wnids = ilsvrc(tmp_path / "data")
    run = tmp_path / "run"
    cli("train", "fashion_mnist", "--run-dir", run, "--set", "data.dataset=imagefolder", "--set", f"data.root={root}",
        "--set", "data.image_size=24", "--set", "data.loader_workers=0", "--set", "batch.global_batch=8",
        "--set", "train.max_steps=2", "--set", "model.width=4", "--set", "train.plots=false", check=True)
    assert json.loads((run / "classes.json").read_text()) == wnids
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["train_images"], summary["val_images"]) == (21, 6)
    (root / "train" / "n00000001").mkdir()   # a class added in front: every label would shift by one
    (root / "train" / WNIDS[0] / f"{WNIDS[0]}_0.JPEG").rename(root / "train" / "n00000001" / "a.JPEG")
    proc = cli("evaluate", run)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "differ from those this run was trained with" in proc.stderr and "first difference at label 0" in proc.stderr


@pytest.mark.parametrize("case", ["missing image", "unknown class", "no labels", "micro-batch conflict"])
def test_bad_imagenet_input_is_one_sentence_exit_2_and_nothing_written(tmp_path, cli, case):
    from conftest import user_error

    root, wnids = ilsvrc(tmp_path / "data")
    labels = tmp_path / "labels.txt"
    sets = [f"data.root={root}", "data.image_size=24", "data.loader_workers=0", "batch.global_batch=8",
            "train.max_steps=1", "model.width=4"]
    if case == "missing image":
        labels.write_text("".join(f"ILSVRC2012_val_{n:08d} {wnids[0]}\n" for n in range(1, 8)))
        sets.append(f"data.val_labels={labels}")
        fragment = "labels 1 image(s) that"
    elif case == "unknown class":
        labels.write_text("".join(f"ILSVRC2012_val_{n:08d} n99999999\n" for n in range(1, 7)))
        sets.append(f"data.val_labels={labels}")
        fragment = "names class(es) ['n99999999'] that train/ does not have"
    elif case == "no labels":
        (tmp_path / "data" / "LOC_val_solution.csv").unlink()
        fragment = "no label file was found; set data.val_labels"
    else:
        sets += ["batch.micro_batch=2", "batch.accumulation=3"]
        fragment = "batch.micro_batch = 2 and batch.accumulation = 3 make 6 images per worker"
    run = tmp_path / "run"
    args = ["train", "fashion_mnist", "--run-dir", run, "--set", "data.dataset=imagefolder"]
    for s in sets:
        args += ["--set", s]
    user_error(cli(*args), fragment)
    assert not run.exists()
