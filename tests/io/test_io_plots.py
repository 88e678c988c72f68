"""io/plots: the figures' backend, axes finish and atomic save."""

from moespec_jax.io import plots


def test_save_writes_one_png_and_closes_the_figure(tmp_path):
  plt = plots.pyplot()
  assert plt.get_backend().lower() == "agg"
  fig, ax = plt.subplots()
  ax.plot([1, 2, 3], [1, 4, 9], label="squares")
  plots.finish_axes(ax, "n", "n^2", "title", legend_fontsize=8)
  assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("n", "n^2", "title")
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ["squares"]
  path = plots.save(fig, tmp_path / "fig.png")
  assert path == tmp_path / "fig.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert [p.name for p in tmp_path.iterdir()] == ["fig.png"]  # no temporary file left
  assert not plt.fignum_exists(fig.number)
