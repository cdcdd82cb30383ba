"""`leap bench predictor`: the predictor service end to end."""

import typer

from leap_cli.output import emit
from study_cli.apps import bench_app


@bench_app.command("predictor")
def bench_predictor(
    dim: int = typer.Option(576, help="feature dimension (576: SmolLM2, 4096: Qwen3-8B)"),
    n: int = typer.Option(200_000, help="items for the saturation run"),
    rate: float = typer.Option(10_000.0, help="offered predictions/s for the latency run"),
    duration: float = typer.Option(3.0, help="seconds of offered load"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Predictor service end to end (queue, batching, product, callback) on one core."""
    from experiments.bench.predictor import bench_predictor as run

    emit(run(dim=dim, n_saturation=n, rate=rate, duration_s=duration), as_json, "predictor service")
