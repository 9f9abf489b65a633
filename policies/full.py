"""`full`: no eviction; the buffer holds every token (the reference all policies are checked against)."""
from . import register
from .base import Policy


@register
class Full(Policy):
    name = "full"
