// Only in a running sweep's page, at the end of its body: reload every data-reload-ms of the
// #auto-reload checkbox, keeping the scroll position; the checkbox pauses it (remembered).
(function () {
  var box = document.getElementById('auto-reload'), where = 'hsdp-dashboard:' + location.pathname;
  try {
    box.checked = localStorage.getItem(where + ':paused') !== '1';
    var y = sessionStorage.getItem(where + ':y');
    if (y !== null) window.scrollTo(0, Number(y));
  } catch (e) { /* storage may be off for file:// pages */ }
  box.addEventListener('change', function () {
    try { localStorage.setItem(where + ':paused', box.checked ? '0' : '1'); } catch (e) {}
  });
  setInterval(function () {
    if (!box.checked) return;
    try { sessionStorage.setItem(where + ':y', String(window.scrollY)); } catch (e) {}
    location.reload();
  }, Number(box.dataset.reloadMs));
})();
