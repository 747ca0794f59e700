"""Webhooks on the command line: `pipeline submit --notify URL`, `pipeline keys webhook`'s
checks, and what `pipeline status JOB` says of a job's deliveries."""
from __future__ import annotations

import functools

import click


def check_url_param(ctx, param, value):
    from jobs.input.field_checks import Bad, storable
    from jobs.webhooks import check_url

    if value is None:
        return None
    try:
        storable(param.human_readable_name, value)
        return check_url(value)
    except (Bad, ValueError) as e:
        raise click.BadParameter(str(e)) from None


def _check_secret(ctx, param, value):
    from jobs.webhooks import secret_key

    if value:
        try:
            secret_key(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value or None


def notify_options(f):
    """--notify URL and --notify-secret, for a command that makes a job: it gets them as one
    parameter, notify=(URL or None, secret or None)."""
    @functools.wraps(f)
    def with_notify(*args, notify, notify_secret, **kwargs):
        return f(*args, notify=(notify, notify_secret), **kwargs)

    with_notify = click.option(
        "--notify-secret", envvar="PIPELINE_NOTIFY_SECRET", metavar="SECRET", callback=_check_secret,
        help="With --notify: the whsec_... secret (Standard Webhooks: base64 of 24 to 64 bytes) that signs "
             "its deliveries, replacing the URL's.  [default: the one made when URL was first notified]")(with_notify)
    return click.option(
        "--notify", metavar="URL", callback=check_url_param,
        help="POST the job's end to URL as OpenAI's batch webhooks are posted (batch.completed, .failed, "
             ".expired, .cancelled; Standard Webhooks signatures), retried with backoff for a day until a "
             "2xx. The first job to notify a URL prints its secret once on stderr; later ones share it.")(with_notify)


def notifying(Session, notify: tuple[str | None, str | None], create):
    """create (a job maker: () -> (job id, shard sizes)), made to have its job notify the URL of
    notify (notify_options' parameter)."""
    url, secret = notify
    if url is None:
        return create

    def create_and_notify():
        from jobs import ledger

        job_id, sizes = create()
        with Session() as s:   # before a shard is sent: no end can come first
            endpoint, made = ledger.cli_endpoint(s, url, secret)
            ledger.notify(s, job_id, endpoint.id)
        if made and secret is None:
            click.echo(f"webhook {url}: its secret, shown only now (later jobs that notify this URL share it): "
                       f"{endpoint.secret}", err=True)
        return job_id, sizes

    return create_and_notify


def print_deliveries(Session, job) -> None:
    """A line for each of the job's webhook deliveries, or where its end will be posted."""
    from jobs import ledger

    with Session() as s:
        deliveries = ledger.deliveries_of_job(s, job.id)
        endpoint = None if deliveries else ledger.endpoint_of(s, job)
    for delivery, url in deliveries:
        click.echo(f"webhook: {delivery.type} ({delivery.id}) to {url}: {_state(delivery)}")
    if endpoint is not None:
        click.echo(f"webhook: to {endpoint.url} once the job has ended")


def _state(d) -> str:
    error = f" ({d.last_error})" if d.last_error else ""
    if d.status == "delivered":
        return f"delivered {d.delivered_at:%Y-%m-%d %H:%M:%S} UTC, attempt {d.attempts}"
    if d.status == "failed":
        return f"given up after {d.attempts} attempt(s){error}"
    if d.status == "sending":
        return f"attempt {d.attempts} being sent"
    if not d.attempts:
        return "pending, first attempt due"
    return f"pending: attempt {d.attempts} failed{error}; next {d.next_attempt_at:%Y-%m-%d %H:%M:%S} UTC"
