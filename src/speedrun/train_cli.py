"""The training area's commands: `speedrun train | eval | recipes | tune-host`."""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

from speedrun.config import absolute_data
from speedrun.console import output_console, print_table
from speedrun.data.kinds import LOADERS
from speedrun.errors import EXIT_FAILED, EXIT_RESUMABLE, SpeedrunError
from speedrun.local_launch import launch_local_processes, process_start_time, strip_option
from speedrun.inputs import PROCESSES, SEED, WORKERS, Bound, given, given_path
from speedrun.spot import IMDS_NOTICE_URL, NOTICE_ENV
from speedrun.recipe import BATCH_SIZE, EPOCHS, IMAGE_SIZE, MEMORY_FORMATS, PRECISIONS, Target
from speedrun.recipes import BUILTIN, DEFAULT, FITTED, recipe_file_tracks
from speedrun.recipes.fitting import recipe_for
from speedrun.trackers import METAVAR as TRACK_METAVAR
from speedrun.trackers import parse_group, parse_tracks


def register(sub: argparse._SubParsersAction) -> None:
    """Add the trainer's commands to the top-level parser."""
    p = sub.add_parser(
        "train",
        help="train a recipe (the default: fashion-mnist)",
        description="Train a recipe to its end or its target. Under torchrun, each process trains on one device.",
        epilog="Exit codes: 0 finished (results.json says whether the target was reached), 1 internal error, "
        "2 bad input or a run directory that cannot be written (the line names the last complete checkpoint), "
        "3 training failed (non-finite loss, a rank died), 75 stopped at a step on request (--resume continues), "
        "130 interrupted.",
    )
    p.add_argument("--recipe", type=given, default=None, metavar="NAME|FILE",
                   help="built-in recipe name or a .py file defining `recipe` (default: fashion-mnist)")
    p.add_argument("--data", type=given, default=None, metavar="PATH",
                   help="dataset location (default: the dataset's own lookup)")
    p.add_argument("--target", default=None, metavar="METRIC=VALUE",
                   help="stop at this accuracy, e.g. top5=0.93 or top1=92; 'none' runs every epoch")
    p.add_argument("--epochs", type=EPOCHS, default=None, metavar="N",
                   help="cut the recipe to N epochs, or stretch every phase in proportion when N is more")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", type=given_path, default=None, metavar="DIR",
                   help="run directory (default: runs/<recipe>-<date>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="auto: bf16 autocast on GPUs that have it (Ampere and later), fp16 with a gradient scaler "
                   "on older ones (V100, T4), fp32 on CPU")
    p.add_argument("--memory-format", choices=MEMORY_FORMATS, default="auto",
                   help="layout of the model and its batches; auto: channels_last on GPUs, and on CPUs (AVX2, "
                   "AVX-512) unless the model has a strided 1x1 convolution too thin for oneDNN's kernel, whose "
                   "channels_last backward corrupts the heap; the run's first line says which and why")
    p.add_argument("--seed", type=SEED, default=0, help="random seed (default 0)")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels: the same numbers run after run")
    p.add_argument("--workers", type=WORKERS, default=None, metavar="N",
                   help="decode processes per device for image folders")
    p.add_argument("--copies", type=given, default=None, metavar="DIR",
                   help="where an image folder's resized copies are (default: $SPEEDRUN_COPIES, else DATA-sz)")
    p.add_argument("--verify-index", action="store_true",
                   help="check the image folder's cached index file by file rather than by folder: also sees "
                   "a file rewritten in place under its own name (docs/data.md, 'The index')")
    p.add_argument("--loader", choices=LOADERS, default="auto",
                   help="image-folder training decode: pil in worker processes; gpu: workers read bytes, torchvision "
                   "decodes on the training device (nvJPEG on CUDA); dali: NVIDIA DALI (needs speedrun[dali]); "
                   "auto: gpu on GPUs with hardware JPEG decoders (A100, H100, H200, B200), else pil")
    p.add_argument("--log-every", type=Bound(int, 1, 1_000_000), default=50, metavar="STEPS",
                   help="steps between train-loss records (default 50)")
    p.add_argument("--track", action="append", default=None, metavar=TRACK_METAVAR,
                   help="also log to an experiment tracker: parameters, metrics, tags, results.json and accuracy.png "
                   "(repeatable; default $SPEEDRUN_TRACK, else the recipe file's `track`; MLflow's URI defaults to "
                   "$MLFLOW_TRACKING_URI, W&B's project to $WANDB_PROJECT, else speedrun)")
    p.add_argument("--track-group", default=None, metavar="NAME",
                   help="with --track: the run's group (MLflow: a parent run of that name; W&B: a group); default "
                   "$SPEEDRUN_TRACK_GROUP, else the launch job's name")
    p.add_argument("--track-checkpoints", action="store_true",
                   help="with --track: upload the final checkpoint too (its path is always a tag)")
    p.add_argument("--checkpoint-every", action="append", default=None, metavar="EPOCHS|MINUTESm",
                   help="epochs between checkpoints, 0 for none (default 1); `10m`: also one mid-epoch every 10 "
                        "minutes (both may be given)")
    p.add_argument("--spot-notice-url", default=os.environ.get(NOTICE_ENV),
                   help="poll this URL for a spot interruption notice and stop at a step when one comes "
                        f"(EC2: {IMDS_NOTICE_URL}; default ${NOTICE_ENV})")
    p.add_argument("--nproc-per-node", type=PROCESSES, default=None, metavar="N",
                   help="start N processes on this machine through torchrun")
    p.add_argument("--sync-bn", action="store_true", help="synchronise BatchNorm statistics across processes")
    p.add_argument("--bucket-cap-mb", type=Bound(float, 0.01, 4096), default=25.0, metavar="MB",
                   help="DDP gradient bucket size (default 25)")
    p.add_argument("--bf16-grads", action="store_true", help="all-reduce gradients in bf16 (CUDA)")
    p.add_argument("--dist-timeout", type=Bound(float, 1, 86_400), default=300.0, metavar="SECONDS",
                   help="how long a collective waits for a peer that does not answer before the run fails, "
                        "naming it (default 300)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "eval",
        help="evaluate a run's checkpoint on the validation split",
        description="Score the checkpoint in RUN_DIR (its EMA weights when the run kept them) on the validation "
        "split, on one process or N, without training. Prints the metrics and appends them to RUN_DIR/eval.jsonl. "
        "Defaults: the recipe's last phase (size, rectangular or square validation, crop_pct) and its eval_flip.",
    )
    p.add_argument("run_dir", type=given_path, metavar="RUN_DIR", help="a run directory holding checkpoint.pt")
    p.add_argument("--data", type=given, default=None, metavar="PATH",
                   help="dataset location (default: the one the run trained on)")
    p.add_argument("--size", type=IMAGE_SIZE, default=None, metavar="PX",
                   help="validation image size in pixels")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--rect", dest="rect", action="store_true", default=None, help="rectangular validation")
    shape.add_argument("--square", dest="rect", action="store_false", help="square centre crops")
    p.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                   help="average each image's logits with its mirror's")
    p.add_argument("--crop-pct", type=Bound(float, 0.01, 1), default=None, metavar="F",
                   help="fraction of the resized image kept: shorter side resized to size / F, centre-cropped "
                   "(1.0: whole square images; 0.877 = 1/1.14 for the ImageNet recipes)")
    p.add_argument("--batch-size", type=BATCH_SIZE, default=None, metavar="N",
                   help="images per device per batch")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--precision", choices=PRECISIONS, default="auto", help="as for train")
    p.add_argument("--workers", type=WORKERS, default=None, metavar="N",
                   help="decode processes per device for image folders")
    p.add_argument("--copies", type=given, default=None, metavar="DIR",
                   help="where an image folder's resized copies are")
    p.add_argument("--nproc-per-node", type=PROCESSES, default=None, metavar="N",
                   help="evaluate on N processes through torchrun")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "tune-host",
        help="show (or --apply) the host settings the record used for multi-machine training",
        description="TCP socket buffers of 16 MiB and a higher open-file limit, as the 2018 record set them. "
        "Without --apply nothing changes.",
    )
    p.add_argument("--apply", action="store_true", help="write the sysctls that are below their wanted value (root)")
    p.set_defaults(func=cmd_tune_host)

    p = sub.add_parser("recipes", help="list the built-in recipes, or print one as a table")
    p.add_argument("name", type=given, nargs="?", help="a built-in recipe name or a recipe .py file")
    p.add_argument("--data", type=given, default=None, metavar="PATH",
                   help=f"the image folder a fitted recipe ({', '.join(FITTED)}) is fitted to")
    p.add_argument("--project", metavar="[GPU:]RATES", action="append", default=[],
                   help="projected wall time of the recipe (without a name: of each ImageNet schedule) from training "
                   "images/s per GPU by size: 128=10842,224=4702,288=2900 or a GPU check's summary .json; with "
                   "--machines, once per GPU kind, named as in the machine types (H100:128=...) or by the summary")
    p.add_argument("--gpus", type=Bound(int, 1, 100_000), default=None,
                   help="with --project: GPUs (default: as many as the recipe was written for)")
    p.add_argument("--scaling", type=Bound(float, 0.01, 1), default=1.0,
                   help="with --project: the fraction of linear speed-up kept across GPUs (default 1.0)")
    p.add_argument("--machines", metavar="TYPE[,TYPE...]",
                   help="with --project: time and $ to the target on these AWS machine types (their GPUs and prices: "
                   "the Price List API or speedrun's table; spot: the spot price history, with AWS credentials)")
    p.add_argument("--count", metavar="N[,N...]",
                   help="with --machines: machines of each type (default: the recipe's GPUs over the type's)")
    p.add_argument("--spot", action="store_true", help="with --machines: at spot prices")
    p.add_argument("--startup-min", type=Bound(float, 0, 1440), default=5.0,
                   help="with --machines: minutes of start-up each run pays for on top (machines booting, code and "
                   "data arriving; default 5)")
    p.set_defaults(func=cmd_recipes)


def cmd_train(args: argparse.Namespace) -> int:
    recipe = recipe_for(args.recipe or DEFAULT, args.data, args.workers)
    if args.epochs is not None:
        recipe = recipe.with_epochs(args.epochs)
    if args.target is not None:
        target = None if args.target.lower() == "none" else Target.parse(args.target)
        recipe = dataclasses.replace(recipe, target=target)
    recipe.validate()
    checkpoint_every, checkpoint_minutes = parse_checkpoint_every(args.checkpoint_every or ["1"])
    track = parse_tracks(args.track, recipe_file_tracks(args.recipe or DEFAULT))
    if args.track_checkpoints and not track:
        raise SpeedrunError("--track-checkpoints uploads to a tracker: give --track too")
    track_group = parse_group(args.track_group)
    if args.spot_notice_url and not args.spot_notice_url.startswith(("http://", "https://")):
        raise SpeedrunError(f"bad --spot-notice-url {args.spot_notice_url!r}: "
                            f"give an http:// URL, e.g. {IMDS_NOTICE_URL}")
    from speedrun.startup import kept_imports

    with kept_imports():  # torch, torchvision: seconds of the collector's time saved (speedrun.startup)
        from speedrun.dist import pick_device
        from speedrun.config import TrainConfig
        from speedrun.engine import train
        from speedrun.money import price_from_env
        from speedrun.learner import check_device_options

    cfg = TrainConfig(
        recipe=recipe,
        out=args.out,
        data=absolute_data(args.data),
        device=args.device,
        resume=args.resume,
        compile=args.compile,
        precision=args.precision,
        memory_format=args.memory_format,
        seed=args.seed,
        deterministic=args.deterministic,
        workers=args.workers,
        copies=args.copies,
        loader=args.loader,
        verify_index=args.verify_index,
        log_every=args.log_every,
        track=track,
        track_group=track_group,
        track_checkpoints=args.track_checkpoints,
        checkpoint_every=checkpoint_every,
        checkpoint_minutes=checkpoint_minutes,
        spot_notice_url=args.spot_notice_url,
        sync_bn=args.sync_bn,
        bucket_cap_mb=args.bucket_cap_mb,
        dist_timeout_s=args.dist_timeout,
        bf16_grads=args.bf16_grads,
        price=price_from_env(),  # what the job layer says the machines cost (speedrun launch)
        process_start=process_start_time(),
    )
    check_device_options(cfg, pick_device(cfg.device))
    if args.nproc_per_node:
        if args.data is not None and not Path(args.data).exists():
            raise SpeedrunError(f"data path {args.data!r} does not exist")
        from speedrun.rundir import default_run_dir

        forwarded = strip_option(args.argv, "--nproc-per-node")
        if args.out is None:  # fix the name here, so that every process writes to the same place
            forwarded += ["--out", str(default_run_dir(recipe.name))]
        return launch_local_processes(forwarded, args.nproc_per_node)
    results = train(cfg)
    if results["status"] == "stopped":
        return EXIT_RESUMABLE
    return 0 if results["status"] in ("finished", "target_reached") else EXIT_FAILED


def parse_checkpoint_every(values: list[str]) -> tuple[int, float | None]:
    """--checkpoint-every values: (epochs between checkpoints, minutes between mid-epoch ones).
    A value is a whole number of epochs or minutes ending in m ("10m", "0.5m"); the last of
    each kind counts. Only minutes given: epoch checkpoints stay at every epoch."""
    epochs, minutes = 1, None
    for value in values:
        text = value.strip().lower()
        try:
            if text.endswith("m"):
                minutes = float(text[:-1])
                if not minutes > 0:
                    raise ValueError
            else:
                epochs = int(text)
                if epochs < 0:
                    raise ValueError
        except ValueError:
            raise SpeedrunError(f"bad --checkpoint-every {value!r}: "
                                "give epochs (0 or more) or minutes, e.g. 10m") from None
    return epochs, minutes


def cmd_eval(args: argparse.Namespace) -> int:
    if not (args.run_dir / "checkpoint.pt").is_file():
        raise SpeedrunError(f"no checkpoint at {args.run_dir / 'checkpoint.pt'}: "
                            "RUN_DIR must be a run directory with a checkpoint")
    if args.nproc_per_node:
        return launch_local_processes(strip_option(args.argv, "--nproc-per-node"), args.nproc_per_node)
    from speedrun.startup import kept_imports

    with kept_imports():
        from speedrun.checkpoint_eval import EvalConfig, evaluate_run

    evaluate_run(EvalConfig(
        run_dir=args.run_dir, data=args.data, size=args.size, rect=args.rect, flip=args.flip,
        crop_pct=args.crop_pct, batch_size=args.batch_size, device=args.device, precision=args.precision,
        workers=args.workers,
        copies=args.copies,
    ))
    return 0


def cmd_tune_host(args: argparse.Namespace) -> int:
    from speedrun import hosttune

    changed = {s.name for s in hosttune.apply()} if args.apply else set()
    table = Table("setting", "current", "wanted", "state", box=None)
    for s in hosttune.plan():
        state = "changed" if s.name in changed else ("ok" if s.ok else "below")
        table.add_row(s.name, s.current, s.wanted, state)
    Console().print(table)
    if not args.apply:
        print("nothing changed; run `speedrun tune-host --apply` as root to write the sysctls, and "
              f"`ulimit -n {hosttune.OPEN_FILES}` in the shell that starts training")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    console = output_console()  # piped to a file or a program: never cut to 80 columns
    if args.project and args.machines:
        return print_cost_projection(console, args)
    if args.count or args.spot or args.startup_min != 5.0:
        raise SpeedrunError("--count, --spot and --startup-min go with --project RATES --machines TYPE")
    if args.project:
        return print_projection(console, args)
    if args.gpus is not None or args.scaling != 1.0 or args.machines:
        raise SpeedrunError("--gpus, --scaling and --machines go with --project RATES")
    if args.name is None:
        table = Table("name", "model", "dataset", "devices", "epochs", "target", box=None)
        for r in BUILTIN.values():
            name = f"{r.name} (default)" if r.name == DEFAULT else r.name
            name += " (fitted to --data)" if r.name in FITTED else ""
            table.add_row(name, r.model, r.dataset, str(r.world_size), str(r.epochs), str(r.target or "-"))
        console.print(table)
        return 0
    recipe = recipe_for(args.name, args.data) if args.data or args.name not in FITTED else BUILTIN[args.name]
    opt = recipe.optimizer
    console.print(
        f"[bold]{recipe.name}[/bold]: {recipe.description}\n"
        f"model {recipe.model}, dataset {recipe.dataset}, written for {recipe.world_size} device(s), "
        f"target {recipe.target or 'none'}\n"
        f"optimizer {opt.name} momentum {opt.momentum} nesterov {opt.nesterov} weight decay {opt.weight_decay} "
        f"(none on {opt.no_decay.replace('_', ' + ')}), label smoothing {opt.label_smoothing}"
        + (f", weight EMA decay {recipe.ema_decay}" if recipe.ema_decay else "")
    )
    print_table(console, recipe.table(), boxed=True)
    return 0


def print_projection(console: Console, args: argparse.Namespace) -> int:
    """`speedrun recipes [NAME] --project RATES`: minutes each schedule would take at those rates,
    next to the 2018 record's and MLPerf's (speedrun.projection)."""
    from speedrun.projection import MLPERF_H200_MINUTES, RECORD_MINUTES, project, read_rates

    if len(args.project) > 1:
        raise SpeedrunError("--project once (rates of one GPU), or once per GPU kind with --machines")
    rates = read_rates(args.project[0])
    recipes = projected_recipes(args)
    sizes = ", ".join(f"{s} px {r:,.0f}" for s, r in sorted(rates.images_per_s.items()))
    console.print(f"projected on {rates.device}: training images/s per GPU {sizes}; scaling {args.scaling:g}; "
                  "ImageNet-1k (1,281,167 training, 50,000 validation images); start-up and compilation not counted")
    rows = []
    for recipe in recipes:
        p = project(recipe, rates, args.gpus, args.scaling)
        record = RECORD_MINUTES.get(recipe.name)
        rows.append({"recipe": recipe.name, "GPUs": p.gpus, "train min": f"{p.train_s / 60:.1f}",
                     "eval min": f"{p.eval_s / 60:.1f}", "projected min": f"{p.total_s / 60:.1f}",
                     "2018 record min (V100s)": f"{record:.1f}" if record else "-"})
    print_table(console, rows, boxed=True)
    console.print("MLPerf v4.0, 8 x H200 (NVIDIA; 75.9% top-1, a little easier than 93% top-5): "
                  f"{MLPERF_H200_MINUTES} min")
    return 0


def projected_recipes(args: argparse.Namespace) -> list:
    """The recipe named, or without a name each ImageNet schedule of the 2018 record."""
    from speedrun.projection import RECORD_MINUTES

    if args.name is None:
        return [r for name, r in BUILTIN.items() if name in RECORD_MINUTES]
    return [recipe_for(args.name, args.data) if args.data or args.name not in FITTED else BUILTIN[args.name]]


def print_cost_projection(console: Console, args: argparse.Namespace) -> int:
    """`speedrun recipes [NAME] --project [GPU:]RATES... --machines TYPE,... [--count N,...] [--spot]`:
    each schedule's projected minutes and $ on each machine type and count, the fastest and the
    cheapest marked, with the assumptions (speedrun.projection.project_cost)."""
    from speedrun.cluster.aws.pricing import gpus_of, offer_prices
    from speedrun.projection import EVAL_SPEEDUP, MachineType, project_cost, rates_for, read_gpu_rates

    if args.gpus is not None:
        raise SpeedrunError("--gpus goes with --project alone; with --machines give --count")
    measured = [read_gpu_rates(spec) for spec in args.project]
    counts = parse_counts(args.count)
    names = [t.strip() for t in args.machines.split(",") if t.strip()]
    unknown = [t for t in names if gpus_of(t) is None]
    if unknown or not names:
        from speedrun.cluster.aws.pricing import INSTANCE_TYPES
        raise SpeedrunError(f"--machines {args.machines!r}: not a GPU machine type speedrun knows "
                            f"({', '.join(unknown) or 'none given'}); known: {', '.join(INSTANCE_TYPES['gpus'])}")
    for t in names:  # refused before any price is asked for (AWS, with credentials)
        gpus, gpu = gpus_of(t)
        if rates_for(gpu, measured) is None:
            raise SpeedrunError(f"{t} has {gpu} GPUs and no rates were given for them: "
                                f"add --project {gpu}:SIZE=IMAGES_PER_S,... or a GPU check's summary from one")
    prices, price_note = offer_prices(names, args.spot)
    types = [MachineType(t, *gpus_of(t), prices[t]) for t in names]
    console.print(f"assumptions: scaling {args.scaling:g} of linear across GPUs; evaluation {EVAL_SPEEDUP:g}x the "
                  f"training rate (forward only); {args.startup_min:g} min start-up per run, billed; ImageNet-1k "
                  f"(1,281,167 training, 50,000 validation images). Prices: {price_note}")
    for recipe in projected_recipes(args):
        rows, options = [], []
        for m in types:
            for n in counts or [max(1, -(-recipe.world_size // m.gpus))]:
                options.append(project_cost(recipe, rates_for(m.gpu, measured), m, n, args.scaling,
                                            args.startup_min * 60))
        fastest = min(options, key=lambda o: o.total_s)
        priced = [o for o in options if o.usd is not None]
        cheapest = min(priced, key=lambda o: o.usd) if priced else None
        for o in options:
            p = o.machine.price
            mark = " ".join(w for w, hit in (("fastest", o is fastest), ("cheapest", o is cheapest)) if hit)
            rows.append({"machines": f"{o.machines} x {o.machine.name}",
                         "GPUs": f"{o.projection.gpus} x {o.machine.gpu}",
                         "$/h each": f"${p.usd_per_hour:,.2f} {p.market}" if p else "no price",
                         "projected min": f"{o.total_s / 60:.1f}",
                         "projected $": f"${o.usd:,.2f}" if o.usd is not None else "-", "": mark})
        console.print(f"[bold]{recipe.name}[/bold] (projected, not measured):")
        print_table(console, rows, boxed=True)
    return 0


def parse_counts(text: str | None) -> list[int]:
    """`--count 1,2,4` as numbers of machines (each 1 or more); [] when not given."""
    if not text:
        return []
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise SpeedrunError(f"--count {text!r}: give machine counts, e.g. 1,2,4") from None
    if any(c < 1 for c in counts):
        raise SpeedrunError(f"--count {text!r}: every count must be 1 or more")
    return counts


__all__ = ["register"]
