"""What `leap serve` settles before the engine starts: the readout files it serves, checked whole, and the
recipe the engine captures.

An engine fixes its capture recipe when it starts, and a readout that reads other columns cannot serve on
it. So the readouts this replica may serve at start (the files given, its saved push, the published
champion, the registry's champion, found under any layer of the model) are read here first, and the engine
captures their recipes with the candidate recipes (`recipes`). A file that cannot serve is refused here,
in one line, before any engine starts; a registry or publication that cannot be read is only noted, as the
engine reports it too. With no registry at all the replica starts on FCFS until a push.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leap_core.layers import default_layer
from leap_core.readout_format import ReadoutFormatError, from_bytes
from leap_core.recipes import Recipe, RecipeError, readout_recipe, union
from leap_io.model_identity import ModelInfo, registered_model_name
from leap_io.push_bundle import BundleError, open_bundle
from leap_io.redact import redact_text, redact_url
from leap_io.settings import LeapSettings
from serving.caller_tenant import TenantKeysError, read_tenant_keys
from serving.readout.push import CaptureSpace, PushRefused, validate_push
from serving.readout.saved_state import ReadoutState, StartFileRefused, StateDamaged, config_bundle


class StartRefused(ValueError):
    """Files `leap serve` was given that must not serve; the message says why, in one line."""


@dataclass
class StartPlan:
    """The engine's LEAP settings `leap serve` adds, and what it found on the way (printed)."""

    leap: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _recipe(metadata: dict) -> Recipe | None:
    try:
        return readout_recipe(metadata)
    except (RecipeError, ValueError, TypeError):
        return None  # a readout naming no recipe serves on none; the check against the capture says so


def _fixed_recipe(settings: LeapSettings, layer: int | None) -> Recipe | None:
    """The recipe the settings fix (as `serving.worker.readout_side_recipe` reads them): `recipe`, else the
    layer (`--layer`, else `layer`); None when the readouts decide."""
    if settings.recipe is not None:
        return Recipe.parse(settings.recipe)
    layer = layer if layer is not None else settings.layer
    return Recipe.last(layer) if layer is not None else None


def _given_files(plan: StartPlan, readout: Path | None, rls_state: Path | None, settings: LeapSettings,
                 expect: dict) -> tuple[bytes | None, Recipe | None]:
    """The bundle of the files given (checked as a push is, before the capture is known) and its recipe."""
    if readout is None:
        if rls_state is not None:
            raise StartRefused("--rls-state needs --readout: an RLS state serves only with its readout")
        return None, None
    try:
        bundle = config_bundle(readout, rls_state, settings.champion_public_key)
        served, _ = validate_push(bundle, expect, None, None)
    except (StartFileRefused, PushRefused) as exc:
        raise StartRefused(str(exc)) from exc
    plan.leap["readout_path"] = str(Path(readout).resolve())
    if rls_state is not None:
        plan.leap["rls_state_path"] = str(Path(rls_state).resolve())
    return bundle, _recipe(served.metadata)


def _registry_champion(plan: StartPlan, settings: LeapSettings, model: ModelInfo, expect: dict,
                       fixed: Recipe | None) -> Recipe | None:
    """The registry's champion's recipe, naming its registered model for the engine; None when there is none."""
    uri = settings.serving_registry_uri()
    if not uri:
        plan.notes.append("no registry: the replica serves no champion from one (FCFS until a push)")
        return None
    plan.leap["registry_uri"] = uri
    layer = next((b.layer for b in fixed.blocks if b.layer is not None), None) if fixed is not None else None
    try:
        from registry.champion_source import find_champion

        found = find_champion(uri, model.model_id, expect, layer=layer, name=settings.registry_model)
    except Exception as exc:  # the engine tries again and reports it; a registry down must not stop a start
        plan.notes.append(f"the registry at {redact_url(uri)} gave no champion: "
                          f"{redact_text(f'{type(exc).__name__}: {exc}')}")
        return None
    if found is None:
        plan.notes.append(f"the registry at {redact_url(uri)} has no champion for {model.model_id} yet")
        return None
    plan.leap["registry_model"] = found.name
    recipe = _recipe(found.metadata)
    plan.notes.append(f"registry champion {found.version} ({found.name} version {found.registry_version}, "
                      f"recipe {recipe})")
    return recipe


def _saved_push(plan: StartPlan, state_dir: str | None) -> Recipe | None:
    """The recipe of the push this replica saved (served again at start), when one is readable."""
    if not state_dir:
        return None
    try:
        saved = ReadoutState(state_dir).load()
        if saved is None:
            return None
        metadata = from_bytes(saved[0]).metadata
    except (StateDamaged, ReadoutFormatError, ValueError) as exc:
        plan.notes.append(f"the saved push in {state_dir} will not serve: {exc}")
        return None
    return _recipe(metadata)


def _published(plan: StartPlan, settings: LeapSettings, name: str | None) -> Recipe | None:
    """The recipe of the champion published for `name` at the replica's champion location."""
    location = plan.leap.get("champion_url")
    if not location or name is None:
        return None
    try:
        from leap_io.champion import ChampionPublication

        published = ChampionPublication(location, endpoint_url=settings.s3_endpoint_url).load(
            name, public_key=settings.champion_public_key)
        if published is None:
            return None
        return _recipe(from_bytes(open_bundle(published.bundle).readout_bytes).metadata)
    except (BundleError, ReadoutFormatError, ValueError, OSError) as exc:
        plan.notes.append(f"the champion published at {redact_url(location)} will not serve: {exc}")
        return None


def plan_start(settings: LeapSettings, model: ModelInfo | None, *, readout: Path | None = None,
               rls_state: Path | None = None, layer: int | None = None,
               state_dir: str | None = None) -> StartPlan:
    """The LEAP settings of a `leap serve` start (see the module docstring); StartRefused for files that
    must not serve. `model` None (a model that is not a local folder): the files are checked without a
    fingerprint or capture, and the engine chooses its capture alone."""
    plan = StartPlan()
    if settings.tenant_keys_file:  # read again by the API front end; a bad file must stop the start here
        try:
            keys = read_tenant_keys(settings.tenant_keys_file)
        except TenantKeysError as exc:
            raise StartRefused(f"LEAP_TENANT_KEYS_FILE: {exc}") from exc
        plan.notes.append(f"tenants from {len(keys)} API keys" + (f", else the {settings.tenant_header} header"
                                                                  if settings.tenant_header else ""))
    elif settings.tenant_header:
        plan.notes.append(f"tenants from the {settings.tenant_header} header (a trusted gateway must set it)")
    expect = {"model_fingerprint": model.fingerprint} if model is not None and model.fingerprint else {}
    bundle, given = _given_files(plan, readout, rls_state, settings, expect)
    explicit_url = settings.given_value("champion_url")
    location = explicit_url if explicit_url is not None else settings.champion_url
    if location:
        plan.leap["champion_url"] = location
    if model is None:
        uri = settings.serving_registry_uri()
        if uri:
            plan.leap["registry_uri"] = uri
        return plan
    try:
        fixed = _fixed_recipe(settings, layer)
        if fixed is not None:
            fixed.check_layers(model.num_layers)
    except RecipeError as exc:
        raise StartRefused(f"the capture asked for does not fit {model.model_id}: {exc}") from exc
    wanted = [given, _registry_champion(plan, settings, model, expect, fixed), _saved_push(plan, state_dir)]
    name = plan.leap.get("registry_model") or settings.registry_model
    if name is None and fixed is not None:
        name = registered_model_name(model.model_id, next(b.layer for b in fixed.blocks if b.layer is not None))
    wanted.append(_published(plan, settings, name))
    capture = fixed
    if capture is None:
        parts = [Recipe.parse(candidate) for candidate in settings.recipes]
        parts += [recipe for recipe in wanted if recipe is not None and recipe not in parts]
        if parts:
            try:
                capture = (parts[0] if len(parts) == 1 else union(parts)).check_layers(model.num_layers)
            except RecipeError as exc:
                raise StartRefused(f"the readouts to serve read layers {model.model_id} lacks: {exc}") from exc
            plan.leap["recipe"] = str(capture)
    if bundle is not None:
        space = CaptureSpace(capture or Recipe.last(default_layer(model.num_layers)), model.hidden_size,
                             model.num_layers)
        try:
            validate_push(bundle, expect, None, space)
        except PushRefused as exc:
            raise StartRefused(str(exc)) from exc
    plan.notes.append(f"capturing {capture}" if capture is not None else
                      f"capturing last@{default_layer(model.num_layers)} (no readout, recipe or layer to go by)")
    return plan
