"""Commands of the HTTP API: serve, and keys add / list / revoke / webhook."""
from __future__ import annotations

import click

from cli.errors import EXIT_USAGE, Fail
from cli.dry_run import check_model
from cli.job_commands import check_broker, sessions
from cli.job_options import SERVED_MODEL_NAME, SHARD_SIZE
from cli.options import job_engine_options, settings_options
from cli.several_models import job_models, several_engines
from cli.webhooks import check_url_param

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on. Serving beyond this machine (e.g. 0.0.0.0) is a deliberate choice: "
                   "the server speaks plain HTTP, so put TLS in front of it.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@job_engine_options
@SHARD_SIZE
@SERVED_MODEL_NAME
# api.connections' timeouts (its defaults, given here so that `pipeline --help` imports no uvicorn).
@click.option("--header-timeout", default=10.0, show_default=True, metavar="SECONDS",
              type=click.FloatRange(min=0, min_open=True, max=3600),
              help="Close a connection whose request line and headers are not whole this long after it "
                   "opened (or after its last response).")
@click.option("--body-timeout", default=30.0, show_default=True, metavar="SECONDS",
              type=click.FloatRange(min=0, min_open=True, max=3600),
              help="Close a connection whose request body brings less than 1 KiB a second over this long "
                   "(a stalled or trickled body).")
@settings_options("broker_url", "max_upload_bytes")
def serve_command(host, port, engine_options, several_models, shard_size, served_model_names, header_timeout,
                  body_timeout, settings):
    """Serve the OpenAI Files and Batches API at http://HOST:PORT/v1 until stopped.

    An OpenAI batch script works unchanged with base_url="http://HOST:PORT/v1" and a key of
    `pipeline keys add`. Each batch is a job like one of `pipeline submit` with these
    options, run by the workers; each key sees only its own files and batches. With --model
    given several times, each line's body.model names one of them (by its --served-model-name
    NAME=MODEL, else as given or by its directory's name) and a batch is a job of the models its
    lines name.
    """
    from api.app import ServerConfig, serve
    from jobs import ledger
    from pipeline.models.bundled import BUNDLED_NAME

    check_broker(settings)   # as `pipeline submit` does: batches could not be queued
    several = several_engines(several_models, served_model_names)   # each model checked there
    if several is None:
        check_model(engine_options.get("model"))
    Session = sessions(settings)
    with Session() as s:
        if not any(key.revoked_at is None for key in ledger.list_keys(s)):
            click.echo("warning: no API key yet: every request is refused (401) until `pipeline keys add NAME`",
                       err=True)
    if host not in LOCAL_HOSTS:
        click.echo(f"warning: serving on {host}, beyond this machine, over plain HTTP: put TLS in front", err=True)
    config = ServerConfig(settings=settings, Session=Session, model=engine_options.get("model") or BUNDLED_NAME,
                          engine_options=engine_options, shard_size=shard_size,
                          served_names=tuple(served_model_names), header_timeout_s=header_timeout,
                          body_timeout_s=body_timeout, models=None if several is None else tuple(job_models(several)))
    serve(config, host, port)


@click.group("keys")
def keys_group():
    """API keys of `pipeline serve` (the ledger keeps only their SHA-256)."""


def _ledger_text(ctx, param, value: str | None) -> str | None:
    """A name the ledger can store and look up: bytes of the command line that are not UTF-8
    reach Python as lone surrogates, which no database driver can send."""
    from jobs.input.field_checks import Bad, storable
    if value is None:   # an option not given
        return None
    try:
        storable(param.human_readable_name, value)
    except Bad as e:
        raise click.BadParameter(f"{e} (give it as UTF-8 text)") from None
    return value


@keys_group.command("add")
@click.argument("name", callback=_ledger_text)
@click.option("--share-answers", metavar="SCOPE", callback=_ledger_text,
              help="Reuse stored answers across every key made with this same SCOPE (e.g. a team's name). "
                   "Off by default: a key's batches reuse only answers computed for that key, so no key "
                   "learns what another one ran.")
@settings_options()
def keys_add_command(name, share_answers, settings):
    """Make a key named NAME (e.g. a team); prints only the key on stdout, once: keep it."""
    from jobs import ledger

    with sessions(settings)() as s:
        try:
            row, key = ledger.add_key(s, name, share_answers=share_answers)
        except ValueError as e:
            raise Fail(str(e), EXIT_USAGE) from None
    click.echo(f"key {row.id} ({row.name}) added; it is shown only now", err=True)
    click.echo(key)


@keys_group.command("list")
@settings_options()
def keys_list_command(settings):
    """Every key: id, name, when it was made and revoked (never the key itself)."""
    from jobs import ledger

    with sessions(settings)() as s:
        keys = ledger.list_keys(s)
        webhooks = ledger.key_endpoints(s)
    if not keys:
        click.echo("no keys yet (`pipeline keys add NAME`)")
    for key in keys:
        revoked = f"revoked {key.revoked_at:%Y-%m-%d %H:%M:%S}" if key.revoked_at else "live"
        webhook = f"  webhook {webhooks[key.id].url}" if key.id in webhooks else ""
        click.echo(f"{key.id}  {key.name}  created {key.created_at:%Y-%m-%d %H:%M:%S}  {revoked}{webhook}")


@keys_group.command("revoke")
@click.argument("name_or_id", callback=_ledger_text)
@settings_options()
def keys_revoke_command(name_or_id, settings):
    """Revoke a key at once: its requests get 401 from then on; its jobs and files stay."""
    from jobs import ledger

    with sessions(settings)() as s:
        key = ledger.revoke_key(s, name_or_id)
    if key is None:
        raise Fail(f"no live key named {name_or_id!r} (see `pipeline keys list`)", EXIT_USAGE)
    click.echo(f"key {key.id} ({key.name}) revoked")


@keys_group.command("webhook")
@click.argument("name_or_id", callback=_ledger_text)
@click.argument("url", required=False, callback=check_url_param)
@click.option("--remove", is_flag=True, help="Post nothing more for this key's batches (URL not given).")
@settings_options()
def keys_webhook_command(name_or_id, url, remove, settings):
    """POST the end of each batch of the key to URL, as OpenAI posts batch webhooks: events
    batch.completed, .failed, .expired and .cancelled, signed as Standard Webhooks sign them.
    Prints only the endpoint's secret (whsec_...) on stdout, once: give it to the receiver
    (openai's client.webhooks.unwrap verifies with it). Replaces the key's endpoint and secret;
    events already made still go to the old one."""
    from jobs import ledger

    if remove == (url is not None):
        raise click.UsageError("give URL, or --remove")
    with sessions(settings)() as s:
        if remove:
            key = ledger.remove_key_endpoint(s, name_or_id)
        else:
            key, endpoint = ledger.set_key_endpoint(s, name_or_id, url) or (None, None)
    if key is None:
        raise Fail(f"no live key named {name_or_id!r} (see `pipeline keys list`)", EXIT_USAGE)
    if remove:
        click.echo(f"key {key.id} ({key.name}): no webhook any more")
        return
    click.echo(f"key {key.id} ({key.name}): batches post their end to {url}; the secret is shown only now",
               err=True)
    click.echo(endpoint.secret)
