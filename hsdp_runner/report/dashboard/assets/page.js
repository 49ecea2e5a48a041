// compare.html's own script, loaded in the head before plotly.js.

// Errors are kept on the page (and so in its DOM) as well as in the console: a chart that did
// not draw then says why, and the browser test reads them from the rendered DOM.
window.dashErrors = [];
function showDashErrors() {
  var box = document.getElementById('js-errors');
  if (!box || !window.dashErrors.length) return;
  box.hidden = false;
  box.textContent = 'JavaScript errors: ' + window.dashErrors.join(' | ');
}
function dashError(message) { window.dashErrors.push(String(message)); showDashErrors(); }
window.addEventListener('error', function (e) { dashError(e.message); });
window.addEventListener('unhandledrejection', function (e) { dashError(e.reason); });
document.addEventListener('DOMContentLoaded', showDashErrors);

// A dozen lines of sorting, rather than a table library embedded next to plotly: each cell's
// data-key is the job's own figure (numbers compare as numbers).
function sortableJobTable() {
  document.querySelectorAll('#jobs th').forEach(function (th, col) {
    th.addEventListener('click', function () {
      var body = th.closest('table').tBodies[0], up = th.dataset.dir !== 'asc';
      th.parentNode.querySelectorAll('th').forEach(function (h) { delete h.dataset.dir; });
      th.dataset.dir = up ? 'asc' : 'desc';
      var key = function (tr) { return tr.cells[col].dataset.key; };
      Array.from(body.rows).sort(function (a, b) {
        var x = key(a), y = key(b), nx = parseFloat(x), ny = parseFloat(y);
        var order = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
        return up ? order : -order;
      }).forEach(function (tr) { body.appendChild(tr); });
    });
  });
}

document.addEventListener('DOMContentLoaded', sortableJobTable);
