"""The inference pipeline (see ARCHITECTURE.md): run_pipeline(request, endpoint) and its hooks.

Import names from the modules that define them (a package face that imports its
modules makes import cycles)."""
