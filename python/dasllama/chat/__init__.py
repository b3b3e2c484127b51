"""The chat layer: templates (and, as it grows, turns, tools and reasoning)."""
from .template import TemplateError, render_messages

__all__ = ["TemplateError", "render_messages"]
