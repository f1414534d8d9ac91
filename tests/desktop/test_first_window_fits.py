"""A new user's first window fits their screen: the default 1,100 x 720 with a window manager's
title bar is taller than a 720 px screen, and unfitted the status bar (model, context,
"Serving at …") would sit below its bottom edge (on Xvfb 1100x720 with openbox: the client area
1100x720 at y 20) until a restart restored a geometry Qt had fitted.
"""
from __future__ import annotations

from PySide6.QtCore import QRect


def test_the_first_window_leaves_room_for_a_title_bar(qtbot, make_window):
    w = make_window()
    assert not w.restored_geometry   # a new user: no saved geometry
    w.resize(1100, 720)
    w.fit_to_screen(QRect(0, 0, 1100, 720))
    assert w.width() <= 1100 and w.height() + 30 <= 720   # a title bar of 30 px still fits
    w.resize(1100, 720)
    w.fit_to_screen(QRect(0, 0, 1366, 768))   # room to spare: the default size stays
    assert (w.width(), w.height()) == (1100, 720)
    w.fit_to_screen(QRect(0, 0, 1024, 600))   # a small screen: smaller in both
    assert w.width() <= 1024 and w.height() + 30 <= 600


def test_a_restored_window_keeps_its_geometry(qtbot, make_window):
    first = make_window()
    first.resize(1000, 650)
    first.close()   # saves the geometry
    again = make_window()
    assert again.restored_geometry
    size = (again.width(), again.height())
    again.fit_to_screen(QRect(0, 0, 1000, 650))   # the launcher calls it for new users only: a no-op here
    assert (again.width(), again.height()) == size


def test_the_app_fits_a_new_users_window_before_showing_it():
    import inspect

    from desktop import launch
    src = inspect.getsource(launch)
    assert src.index("fit_to_screen()") < src.index("window.show()")
