"""`rlmill data make`: a built-in dataset as verl-format train/test Parquet.

    rlmill data make arith --out data/arith
    rlmill data make gsm_symbolic --out s3://my-bucket/data/gsm --train-size 2000 --test-size 200
"""

from __future__ import annotations

import argparse

from flows.user_errors import UserError

__all__ = ["add_data_parser", "cmd_data_make"]

# Sizes `rlmill data make` writes when --train-size / --test-size are not given.
DEFAULT_TRAIN_SIZE, DEFAULT_TEST_SIZE = 20000, 1000


def add_data_parser(sub, formatter_class) -> None:
    """`rlmill data make ...` under the command parsers `sub`."""
    from gpu_jobs.data import dataset_names

    data = sub.add_parser("data", help="datasets: rlmill data make ...").add_subparsers(
        dest="data_command", required=True, metavar="command")
    make = data.add_parser("make", help="write a built-in dataset as verl-format train/test Parquet",
                           description="Write a built-in dataset as verl-format train/test Parquet.",
                           formatter_class=formatter_class, epilog=_data_make_help())
    make.add_argument("name", help=" | ".join(dataset_names()))
    make.add_argument("--out", required=True, help="folder URL (local, s3://...)")
    make.add_argument("--train-size", type=_row_count, default=None,
                      help=f"training rows (default {DEFAULT_TRAIN_SIZE}; arith: all its prompts but the test ones)")
    make.add_argument("--test-size", type=_row_count, default=None,
                      help=f"held-out rows (default {DEFAULT_TEST_SIZE}, never shared with train)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--train-only", action="store_true",
                      help="write train.parquet only (its rows still exclude the test rows): for a nightly "
                           "incoming folder, where every Parquet file counts as training data")
    make.set_defaults(fn=cmd_data_make)


def _data_make_help() -> str:
    from gpu_jobs.data import dataset_names

    return f"""\
Writes <out>/train.parquet and <out>/test.parquet in verl's format (data_source, prompt,
ability, reward_model, extra_info); a run reads them with data.train_files=... data.val_files=....
Datasets: {' | '.join(dataset_names())}.

examples:
  rlmill data make arith --out data/arith
  rlmill data make gsm_symbolic --out s3://my-bucket/data/gsm --train-size 2000 --test-size 200
  rlmill data make rg:countdown --out data/countdown
"""


def _row_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or more rows")
    return value



def _data_sizes(name: str, train: int | None, test: int | None) -> tuple[int, int]:
    """--train-size / --test-size, with the dataset's defaults for the ones not given: arith has
    only 8100 distinct prompts, so its defaults share them out (7100 train + 1000 test); times
    has 121, so 40 are held out and the train split repeats the rest (1000 rows); times25 has
    576, so 200 are held out."""
    from flows.config import ARITH_PROBLEMS
    from gpu_jobs.data.generators import TIMES_TABLES

    if name in TIMES_TABLES:  # few prompts: whole facts held out, the train split repeats the rest in order
        family = TIMES_TABLES[name]
        default_test = family.default_held_out
        if test is not None and test > family.max_held_out:
            raise UserError(f"{name} has {family.prompts} prompts in all and holds out at most {family.max_held_out} "
                            f"(whole facts, both orders): --test-size {test} asks for more; leave it out for "
                            f"{default_test}")
        return (1000 if train is None else train), (default_test if test is None else test)
    if name != "arith":
        return (DEFAULT_TRAIN_SIZE if train is None else train), (DEFAULT_TEST_SIZE if test is None else test)
    total = ARITH_PROBLEMS
    for flag, value in (("--train-size", train), ("--test-size", test)):
        if value is not None and value > total:
            raise UserError(f"arith has only {total} distinct prompts; {flag} {value} asks for more: give at "
                            f"most {total} in all, or leave the sizes out (default: all of them, "
                            f"{total - DEFAULT_TEST_SIZE} train + {DEFAULT_TEST_SIZE} test)")
    if train is None and test is None:
        return total - DEFAULT_TEST_SIZE, DEFAULT_TEST_SIZE
    if train is None:
        return total - test, test
    if test is None:
        return train, min(DEFAULT_TEST_SIZE, total - train)
    if train + test > total:
        raise UserError(f"arith has only {total} distinct prompts; --train-size {train} + --test-size {test} = "
                        f"{train + test}: lower them to at most {total} in all, or leave them out (default: "
                        f"{total - DEFAULT_TEST_SIZE} train + {DEFAULT_TEST_SIZE} test)")
    return train, test


def _check_dataset_name(name: str) -> None:
    from gpu_jobs.data import GENERATORS, dataset_names

    if name in GENERATORS:
        return
    if name.startswith("rg:") and len(name) > 3:
        from reasoning_gym.factory import DATASETS

        if name[3:] in DATASETS:
            return
        import difflib

        close = difflib.get_close_matches(name[3:], DATASETS, n=3)
        hint = f"did you mean {' or '.join('rg:' + c for c in close)}?" if close else "e.g. rg:countdown, rg:basic_arithmetic"
        raise UserError(f"reasoning-gym has no task {name[3:]!r} ({len(DATASETS)} tasks; {hint})")
    raise UserError(f"unknown dataset {name!r}: use one of {' | '.join(dataset_names())}")


def cmd_data_make(args) -> None:
    from gpu_jobs.data import make_dataset
    from storage import StorageConfig
    from storage.probe import check_root

    _check_dataset_name(args.name)
    train_size, test_size = _data_sizes(args.name, args.train_size, args.test_size)
    check_root(args.out, StorageConfig())  # --out answers and takes writes (the AWS_* environment's S3)
    if args.train_only:
        train = _make_train_only(args.name, args.out, train_size, test_size, args.seed)
        print(f"wrote {train} ({train_size} rows; the {test_size} test rows of seed {args.seed} left out of it)")
        return
    train, test = make_dataset(args.name, args.out, train_size=train_size, test_size=test_size, seed=args.seed)
    print(f"wrote {train} ({train_size} rows)\nwrote {test} ({test_size} rows)")


def _make_train_only(name: str, out: str, train_size: int, test_size: int, seed: int) -> str:
    """Only <out>/train.parquet, drawn exactly as `data make` draws it (so it never holds the
    held-out rows of the same seed): for a nightly incoming folder, where every Parquet file
    under the prefix is new training data. Generated in memory, then moved into place whole."""
    import uuid

    from storage import join, url_to_fs
    from gpu_jobs.data import make_dataset

    scratch = f"memory://rlmill-data-make-{uuid.uuid4().hex}"
    mem_train, _ = make_dataset(name, scratch, train_size=train_size, test_size=test_size, seed=seed)
    mem, mem_path = url_to_fs(mem_train)
    data = mem.cat_file(mem_path)
    mem.rm(scratch.removeprefix("memory://"), recursive=True)
    dest = join(out, "train.parquet")
    fs, path = url_to_fs(dest)
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    tmp = f"{parent}/.train.parquet.tmp-{uuid.uuid4().hex[:8]}"  # hidden: a nightly listing skips it
    fs.pipe_file(tmp, data)
    fs.mv(tmp, path)
    return dest
