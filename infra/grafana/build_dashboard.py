"""Builds infra/grafana/leap-dashboard.json: LEAP's panels beside vLLM's latency and queue panels.

Run `python infra/grafana/build_dashboard.py` after changing a panel (it rewrites the JSON; `--check`
only says whether the committed file is current). Every query reads the serving port's `/metrics`, where
vLLM's `vllm:*` and LEAP's `leap:*` families are exposed together; `tests/test_prometheus.py` evaluates
each one against a real Prometheus scraping a real `leap serve`. Built with grafana-foundation-sdk so the
JSON follows Grafana's own schema.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos, VariableRefresh

OUTPUT = Path(__file__).with_name("leap-dashboard.json")
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'instance=~"$instance"'  # every selector: the replicas chosen above the dashboard
RATE = "$__rate_interval"


def _q(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)


def _quantiles(metric: str, extra: str = "") -> list[prometheus.Dataquery]:
    by = f"sum by (le{extra}) (rate({metric}_bucket{{{SEL}}}[{RATE}]))"
    return [_q(f"histogram_quantile({q}, {by})", f"p{round(q * 100)}", ref) for q, ref in ((0.5, "A"), (0.95, "B"))]


def _series(title: str, unit: str, queries: list[prometheus.Dataquery], x: int, y: int, w: int = 8,
            description: str = "") -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE).description(description)
    for query in queries:
        panel = panel.with_target(query)
    return panel.grid_pos(GridPos(h=8, w=w, x=x, y=y))


def panels() -> list:
    """(row title, panels) in order; the y of each panel is its row's."""
    rows: list = []
    rows.append(dashboard.Row("Latency and queue (vLLM)").grid_pos(GridPos(h=1, w=24, x=0, y=0)))
    rows += [
        _series("End-to-end latency", "s", _quantiles("vllm:e2e_request_latency_seconds"), 0, 1),
        _series("Time to first token", "s", _quantiles("vllm:time_to_first_token_seconds"), 8, 1),
        _series("Queue time", "s", _quantiles("vllm:request_queue_time_seconds"), 16, 1),
        _series("Requests running and waiting", "short", [
            _q(f"sum by (instance) (vllm:num_requests_running{{{SEL}}})", "running {{instance}}", "A"),
            _q(f"sum by (instance) (vllm:num_requests_waiting{{{SEL}}})", "waiting {{instance}}", "B")], 0, 9, 12),
        _series("Predicted outstanding decode work", "short", [
            _q(f"leap:predicted_outstanding_tokens{{{SEL}}}", "{{instance}}", "A")], 12, 9, 12,
            "Predicted remaining output tokens of each replica's resident requests: what a gateway scorer reads"),
    ]
    rows.append(dashboard.Row("Prediction").grid_pos(GridPos(h=1, w=24, x=0, y=17)))
    ratio = (f"sum(rate(leap:{{name}}_sum{{{{{SEL}}}}}[{RATE}])) / sum(rate(leap:{{name}}_count{{{{{SEL}}}}}[{RATE}]))")
    rows += [
        _series("Predicted against true output length", "short", [
            _q(ratio.format(name="predicted_generation_tokens"), "mean predicted", "A"),
            _q(ratio.format(name="actual_generation_tokens"), "mean true", "B"),
            _q(f"histogram_quantile(0.9, sum by (le) (rate(leap:predicted_generation_tokens_bucket{{{SEL}}}[{RATE}])))",
               "p90 predicted", "C"),
            _q(f"histogram_quantile(0.9, sum by (le) (rate(leap:actual_generation_tokens_bucket{{{SEL}}}[{RATE}])))",
               "p90 true", "D")], 0, 18, 12,
            "Finished requests with a prediction: predicted at admission against generated, in tokens"),
        _series("Live Spearman (last 256 finished)", "short", [
            _q(f'leap:rolling_spearman{{domain="all",{SEL}}}', "{{instance}}", "A")], 12, 18, 6),
        _series("Live MAE (tokens)", "short", [
            _q(f'leap:rolling_mae_tokens{{domain="all",{SEL}}}', "served {{instance}}", "A"),
            _q(f'leap:anchor_mae_tokens{{domain="all",{SEL}}}', "anchor {{instance}}", "B")], 18, 18, 6),
        _series("Prediction ready before decode", "percentunit", [
            _q(f"sum(rate(leap:prediction_ready_total{{{SEL}}}[{RATE}])) / (sum(rate(leap:prediction_ready_total"
               f"{{{SEL}}}[{RATE}])) + sum(rate(leap:prediction_missed_total{{{SEL}}}[{RATE}])))", "ready", "A")],
            0, 26, 12),
        _series("Predictor queue", "short", [_q(f"leap:predictor_queue{{{SEL}}}", "{{instance}}", "A")], 12, 26, 12),
    ]
    rows.append(dashboard.Row("Scheduling and state").grid_pos(GridPos(h=1, w=24, x=0, y=34)))
    rows += [
        _series("Decode order changes and hold-outs", "ops", [
            _q(f"sum by (instance) (rate(leap:reordered_steps_total{{{SEL}}}[{RATE}]))", "reordered steps {{instance}}",
               "A"),
            _q(f"sum by (instance) (rate(leap:held_out_request_steps_total{{{SEL}}}[{RATE}]))",
               "held out {{instance}}", "B")], 0, 35, 12),
        _series("Drops by what and why", "ops", [
            _q(f"sum by (what, reason) (rate(leap:dropped_total{{{SEL}}}[{RATE}])) or vector(0)", "{{what}} {{reason}}",
               "A")],
            12, 35, 12),
        stat.Panel().title("Kill switch and shadow").datasource(DATASOURCE)
        .with_target(_q(f"leap:kill_switch{{{SEL}}}", "kill switch {{instance}}", "A"))
        .with_target(_q(f"leap:shadow_active{{{SEL}}}", "shadow {{instance}}", "B"))
        .grid_pos(GridPos(h=6, w=12, x=0, y=43)),
        table.Panel().title("Served readout by replica").datasource(DATASOURCE)
        .with_target(_q(f"leap:readout_info{{{SEL}}}", "{{version}}", "A").format("table").instant())
        .grid_pos(GridPos(h=6, w=12, x=12, y=43)),
    ]
    return rows


def build() -> dict:
    board = (dashboard.Dashboard("LEAP serving").uid("leap-serving").tags(["leap", "vllm"]).refresh("30s")
             .time("now-1h", "now").editable()
             .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
             .with_variable(dashboard.QueryVariable("instance").label("Replica").datasource(DATASOURCE)
                            .query("label_values(leap:num_requests_resident, instance)").multi(True)
                            .include_all(True).all_value(".*").refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)))
    for panel in panels():
        board = board.with_row(panel) if isinstance(panel, dashboard.Row) else board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        print("current" if current == text else f"{OUTPUT} is stale: run python {Path(__file__).name}")
        return 0 if current == text else 1
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
