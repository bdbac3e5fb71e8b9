/* The course site's behaviours (tools/site/theme/course_book). Without JavaScript
   every output shows whole and every picture at the column's width.

   1. A long printed output is folded: its first lines show, a button shows the rest
      (and folds it again). Long means taller than FOLD_LINES lines as laid out, after
      the wrapping of long lines.
   2. A picture scaled down to the column (a wide figure, a strip of frames) opens at
      its own size on a click; a click or Escape closes it.
   3. The sidebar shows the open page's entry. */
(function () {
  "use strict";
  var FOLD_LINES = 30;   // fold an output taller than this many lines
  var KEEP_LINES = 14;   // and show this many of them

  function lineHeight(el) {
    var style = window.getComputedStyle(el);
    var lh = parseFloat(style.lineHeight);
    return isNaN(lh) ? 1.45 * parseFloat(style.fontSize) : lh;
  }

  function fold(pre) {
    var box = pre.closest(".output");
    if (!box || box.classList.contains("foldable")) return;
    var lh = lineHeight(pre);
    if (pre.scrollHeight <= FOLD_LINES * lh) return;
    var lines = pre.textContent.replace(/\n$/, "").split("\n").length;
    var button = document.createElement("button");
    button.type = "button";
    button.className = "fold-toggle";
    box.classList.add("foldable", "folded");
    box.style.setProperty("--fold-height", Math.round(KEEP_LINES * lh + 9) + "px");
    function label() {
      var folded = box.classList.contains("folded");
      button.textContent = folded ? "Show all " + lines + " lines" : "Fold the output";
      button.setAttribute("aria-expanded", folded ? "false" : "true");
    }
    button.addEventListener("click", function () {
      var folded = box.classList.toggle("folded");
      label();
      if (folded && box.getBoundingClientRect().top < 0) box.scrollIntoView({block: "start"});
    });
    label();
    box.insertAdjacentElement("afterend", button);
  }

  function tooSmall(img) { return img.naturalWidth > img.clientWidth * 1.15; }

  function zoomable(img) {
    function check() {
      if (tooSmall(img)) {
        img.classList.add("zoomable");
        img.title = "Click to see the picture at its own size";
      }
    }
    if (img.complete) check(); else img.addEventListener("load", check);
  }

  function zoom(img) {
    var view = document.createElement("div");
    view.className = "zoom-view";
    view.setAttribute("role", "dialog");
    view.setAttribute("aria-label", "The picture at its own size");
    var big = document.createElement("img");
    big.src = img.src;
    big.alt = img.alt;
    view.appendChild(big);
    function close() { view.remove(); document.removeEventListener("keydown", onKey); }
    function onKey(e) { if (e.key === "Escape") close(); }
    view.addEventListener("click", close);
    document.addEventListener("keydown", onKey);
    document.body.appendChild(view);
  }

  // one listener for every output picture, those added after the page loaded too
  document.addEventListener("click", function (e) {
    var img = e.target.closest ? e.target.closest("div.cell_output img") : null;
    if (img && tooSmall(img)) zoom(img);
  });

  // the sidebar scrolls on its own: bring this page's entry into its view
  function showCurrent() {
    var side = document.querySelector("div.sphinxsidebar");
    var here = side && side.querySelector('nav.book-nav [aria-current="page"]');
    if (!here || side.scrollHeight <= side.clientHeight) return;
    var offset = here.getBoundingClientRect().top - side.getBoundingClientRect().top;
    if (offset > side.clientHeight * 0.8) side.scrollTop += offset - side.clientHeight / 3;
  }

  function init() {
    document.querySelectorAll("div.cell_output .output pre").forEach(fold);
    document.querySelectorAll("div.cell_output img").forEach(zoomable);
    showCurrent();
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
