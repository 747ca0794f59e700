"""The names of a job of several models (jobs.several_models.SeveralEngines): each model as given
or by its directory's name, or exactly its served names (--served-model-name NAME=MODEL), kept
by the ledger's models column for a retry, and kept when a server's models are narrowed."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from jobs.several_models import SeveralEngines


def _engines(*served: str, models=("/x/a", "/y/b")) -> SeveralEngines:
    return SeveralEngines([(model, {"model": model}) for model in models], served)


def test_without_served_names_a_model_is_named_as_given_or_by_its_directorys_name():
    engines = _engines()
    assert engines.names == ("/x/a", "a", "/y/b", "b")
    assert [engines.model_of(name) for name in engines.names] == [0, 0, 1, 1]


def test_a_model_given_served_names_is_named_by_exactly_those():
    engines = _engines("gpt-4o-mini=a", "mini=/x/a", "gpt-4o-mini=a")
    assert engines.names == ("gpt-4o-mini", "mini", "/y/b", "b")
    assert engines.served_names == [["gpt-4o-mini", "mini"], []]


def test_served_names_tell_apart_two_models_whose_directories_share_a_name():
    with pytest.raises(ValueError, match="both called 'a'"):
        _engines(models=("/x/a", "/y/a"))
    engines = _engines("first=/x/a", "second=/y/a", models=("/x/a", "/y/a"))
    assert engines.names == ("first", "second")
    with pytest.raises(ValueError, match="if no other has it"):   # "a" could be either
        _engines("first=a", models=("/x/a", "/y/a"))


@pytest.mark.parametrize("served", ["gpt-4o", "=a", "gpt-4o=", "gpt-4o=c", "b=a"])
def test_a_served_name_that_names_no_model_or_another_models_name_is_refused(served):
    with pytest.raises(ValueError, match="NAME=MODEL|both called"):
        _engines(served)


def test_the_ledgers_models_keep_the_served_names_for_a_retry_and_a_narrowed_server_too():
    engines = _engines("gpt-4o-mini=a")
    engines._fingerprints = {0: "fa", 1: "fb"}   # as if read from the model files
    models = engines.ledger_models()
    assert models[0]["served_names"] == ["gpt-4o-mini"] and "served_names" not in models[1]
    again = SeveralEngines.of_job(SimpleNamespace(models=models))
    assert (again.models, again.names) == (engines.models, engines.names)
    narrowed = engines.only([0])
    assert (narrowed.models, narrowed.names, narrowed.fingerprints) == (["/x/a"], ("gpt-4o-mini",), ["fa"])
