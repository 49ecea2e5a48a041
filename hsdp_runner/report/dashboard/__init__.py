"""compare.html: the page, its charts, and the Hydra callback that rebuilds it during a sweep."""
