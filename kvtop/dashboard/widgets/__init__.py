"""kvtop's widgets: one panel or screen per module, each drawing from a View (see view.py)."""
