"""The dashboard: the Textual app `kvtop`, its panels, dialogs, keys and actions."""
