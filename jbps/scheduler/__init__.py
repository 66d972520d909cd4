"""The rendezvous of the environment-variable bootstrap: `python -m jbps.scheduler`."""

from .rendezvous import Registration, Scheduler

__all__ = ["Registration", "Scheduler"]
