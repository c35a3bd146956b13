// The overview's charts: uPlot over the JSON the page embeds (#overview-data, #groups-data). Drawn on load and
// again after each htmx refresh of the page body.
(function () {
  "use strict";
  var COLORS = {p50: "#3b8bd9", p95: "#e6a23c", p99: "#d9534f", rate: "#3b8bd9", errors: "#c0392b",
                network_ms: "#b0b8c4", gateway_ms: "#9b7ed1", overhead_ms: "#8aa0b8", queue_ms: "#e6a23c",
                prefill_ms: "#d9534f", decode_ms: "#3bb27a", lookup: "#17a2b8", semantic: "#9b7ed1"};
  var GROUP_COLORS = ["#3b8bd9", "#e6a23c", "#3bb27a", "#9b7ed1", "#d9534f", "#7c8da3"];
  var COMPONENTS = ["network_ms", "gateway_ms", "overhead_ms", "queue_ms", "prefill_ms", "decode_ms"];
  var charts = [];

  function read(id) {
    var node = document.getElementById(id);
    return node ? JSON.parse(node.textContent) : null;
  }

  // Ratios (0..1) drawn in percent.
  function percents(values) { return values.map(function (v) { return v == null ? null : 100 * v; }); }
  function pct(u, v) { return v == null ? "–" : v.toFixed(1) + "%"; }

  function fmt(v) { return v == null ? "–" : (Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(2)); }

  // A y axis as wide as its longest tick label, at least `minimum` px: a fixed size cut "16.075" to "6.075".
  var measure = document.createElement("canvas").getContext("2d");
  function yAxis(minimum) {
    return {size: function (u, values) {
      if (!values) { return minimum; }
      measure.font = "12px system-ui, -apple-system, sans-serif";  // uPlot's axis font
      var widest = values.reduce(function (w, v) { return Math.max(w, measure.measureText(String(v)).width); }, 0);
      return Math.max(minimum, Math.ceil(widest) + 22);  // the ticks (10 px) and the gap before the labels
    }};
  }

  function line(label, color, values, extra) {
    var s = {label: label, stroke: color, width: 1.5, value: function (u, v) { return fmt(v); }, spanGaps: false};
    for (var k in (extra || {})) { s[k] = extra[k]; }
    return s;
  }

  // Stacked areas: each series drawn as the running sum, filled; the legend shows the component's own value.
  function stacked(data, suffix) {
    var xs = data.t, sums = xs.map(function () { return 0; }), series = [{}], columns = [xs], own = [];
    COMPONENTS.forEach(function (name) {
      var values = data[name + "_" + suffix];
      if (!values.some(function (v) { return v != null; })) { return; }
      sums = sums.map(function (s, i) { return s + (values[i] || 0); });
      own.push(values);
      columns.push(sums.slice());
      series.push({label: name.replace("_ms", ""), stroke: COLORS[name], fill: COLORS[name] + "cc", width: 1});
    });
    // Draw the largest running sum first so that each smaller one paints over it.
    var order = columns.slice(1).map(function (_, i) { return i; }).reverse();
    var drawn = [xs], drawnSeries = [{}];
    order.forEach(function (i) {
      drawn.push(columns[i + 1]);
      var s = series[i + 1], values = own[i];
      s.value = function (u, v, si, idx) { return idx == null ? "–" : fmt(values[idx]); };
      drawnSeries.push(s);
    });
    return {columns: drawn, series: drawnSeries};
  }

  // The x axis spans the range asked for (`since`..`until` of the page's data), whatever the data covers.
  var xRange = null;
  // Rollout events (overview-data.annotations: {t, label}) drawn as dashed vertical lines on the time series.
  var marks = [];

  function annotate(u) {
    if (!marks.length) { return; }
    var ctx = u.ctx, top = u.bbox.top, bottom = u.bbox.top + u.bbox.height;
    ctx.save();
    ctx.strokeStyle = "#9a6400";
    ctx.fillStyle = "#9a6400";
    ctx.lineWidth = 1;
    ctx.setLineDash([4, 3]);
    ctx.font = (10 * devicePixelRatio) + "px sans-serif";
    marks.forEach(function (m) {
      var x = Math.round(u.valToPos(m.t, "x", true));
      if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) { return; }
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, bottom);
      ctx.stroke();
      ctx.fillText("#" + m.rollout, x + 3, top + 10 * devicePixelRatio);
    });
    ctx.restore();
  }

  function make(node, series, columns, plain) {
    var width = Math.max(node.clientWidth, 300);
    var x = {time: !plain};
    if (xRange && !plain) { x.range = function () { return xRange; }; }
    var opts = {width: width, height: 210, series: series, scales: {x: x},
                axes: [{}, yAxis(56)], legend: {live: true}, cursor: {drag: {x: false, y: false}},
                hooks: plain ? {} : {draw: [annotate]}};
    node.innerHTML = "";
    var chart = new uPlot(opts, columns, node);
    node.setAttribute("data-drawn", String(columns[0].length));
    charts.push({chart: chart, node: node});
  }

  // A constant series drawn dashed (a tier's burn-rate threshold).
  function threshold(label, value, xs) {
    return {series: {label: label, stroke: "#c0392b", width: 1, dash: [6, 4], points: {show: false},
                     value: function () { return value + "×"; }},
            values: xs.map(function () { return value; })};
  }

  function drawSlo(data) {
    document.querySelectorAll("[data-chart]").forEach(function (node) {
      var kind = node.getAttribute("data-chart");
      if (kind === "burn") {
        var series = [{}], columns = [data.t];
        data.windows.forEach(function (w, i) {
          series.push(line(w, GROUP_COLORS[i % GROUP_COLORS.length]));
          columns.push(data.burn[i]);
        });
        data.thresholds.forEach(function (factor) {
          var th = threshold(factor + "× tier", factor, data.t);
          series.push(th.series);
          columns.push(th.values);
        });
        make(node, series, columns);
      } else if (kind === "budget") {
        make(node, [{}, line("budget remaining", COLORS.rate, null,
                             {value: function (u, v) { return v == null ? "–" : (100 * v).toFixed(2) + "%"; }})],
             [data.t, data.budget]);
      }
    });
  }

  // A regression run's distributions: both arms' ECDFs per metric, x in milliseconds (not time).
  function drawEcdf(data) {
    document.querySelectorAll("[data-ecdf]").forEach(function (node) {
      var d = data[node.getAttribute("data-ecdf")];
      if (!d || !d.x.length) { return; }
      var share = function (u, v) { return v == null ? "–" : (100 * v).toFixed(1) + "%"; };
      make(node, [{label: "ms", value: function (u, v) { return fmt(v) + " ms"; }},
                  line("baseline", "#7c8da3", null, {value: share, paths: uPlot.paths.stepped({align: 1})}),
                  line("candidate", "#e6a23c", null, {value: share, paths: uPlot.paths.stepped({align: 1})})],
           [d.x, d.baseline, d.candidate], true);
    });
  }

  // The engine page's engine models: a figure's quantiles, observed and as the model replays them (x: the quantile).
  function drawModelCurves(data) {
    var ms = function (u, v) { return v == null ? "–" : fmt(v) + " ms"; };
    document.querySelectorAll("[data-model-curve]").forEach(function (node) {
      var at = node.getAttribute("data-model-curve").split(":"), d = (data[at[0]] || {})[at[1]];
      if (!d || !d.q.length) { return; }
      make(node, [{label: "quantile", value: function (u, v) { return v == null ? "–" : "p" + v; }},
                  line("observed", COLORS.p50, null, {value: ms}),
                  line("model", COLORS.p95, null, {value: ms, dash: [6, 4]})],
           [d.q, d.observed, d.predicted], true);
    });
  }

  function draw() {
    charts.forEach(function (c) { c.chart.destroy(); });
    charts = [];
    if (typeof uPlot === "undefined") { return; }
    var models = read("engine-model-data");
    if (models) { drawModelCurves(models); return; }
    var ecdf = read("regression-data");
    if (ecdf) { drawEcdf(ecdf); return; }
    var slo = read("slo-data");
    if (slo) { xRange = [slo.since, slo.until]; drawSlo(slo); return; }
    var data = read("overview-data");
    if (!data) { return; }
    xRange = [data.since, data.until];
    marks = data.annotations || [];
    document.querySelectorAll("[data-chart]").forEach(function (node) {
      var kind = node.getAttribute("data-chart");
      if (kind === "rate") {
        var cached = data.t.map(function (_, i) { return data.exact_cache_rate[i] + data.semantic_cache_rate[i]; });
        make(node, [{}, line("requests/s", COLORS.rate), line("from cache/s", COLORS.lookup),
                    line("errors/s", COLORS.errors)], [data.t, data.rate, cached, data.errors]);
      } else if (kind === "prefix_hit_ratio") {
        make(node, [{}, line("tokens", COLORS.p50, null, {value: pct}), line("requests", COLORS.p95, null, {value: pct})],
             [data.t, percents(data.prefix_token_hit_ratio), percents(data.prefix_request_hit_ratio)]);
      } else if (kind === "prefill_per_token") {
        make(node, [{}, line("prefill ms / computed token", COLORS.prefill_ms)], [data.t, data.prefill_ms_per_uncached_token]);
      } else if (kind === "response_cache") {
        make(node, [{}, line("exact", COLORS.lookup, null, {value: pct}), line("semantic", COLORS.semantic, null, {value: pct})],
             [data.t, percents(data.exact_cache_share), percents(data.semantic_cache_share)]);
      } else if (kind === "class_e2e") {
        make(node, [{}, line("engine", COLORS.rate), line("exact cache", COLORS.lookup), line("semantic cache", COLORS.semantic)],
             [data.t, data.e2e_ms_p50, data.exact_cache_e2e_p50, data.semantic_cache_e2e_p50]);
      } else if (kind === "e2e_ms" || kind === "ttft_ms" || kind === "tpot_ms") {
        make(node, [{}, line("p50", COLORS.p50), line("p95", COLORS.p95), line("p99", COLORS.p99)],
             [data.t, data[kind + "_p50"], data[kind + "_p95"], data[kind + "_p99"]]);
      } else if (kind === "decomposition_mean" || kind === "decomposition_p95") {
        var st = stacked(data, kind === "decomposition_mean" ? "mean" : "p95");
        make(node, st.series, st.columns);
      } else if (kind === "groups_e2e" || kind === "groups_ttft") {
        var groups = read("groups-data");
        if (!groups) { return; }
        var key = kind === "groups_e2e" ? "e2e_p95" : "ttft_p95";
        var series = [{}], columns = [groups.t];
        groups.groups.forEach(function (name, i) {
          series.push(line(name, GROUP_COLORS[i % GROUP_COLORS.length]));
          columns.push(groups[key][i]);
        });
        make(node, series, columns);
      }
    });
  }

  var resizeTimer = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(function () {
      charts.forEach(function (c) { c.chart.setSize({width: Math.max(c.node.clientWidth, 300), height: 210}); });
    }, 150);
  });
  document.addEventListener("DOMContentLoaded", draw);

  // The engine page's live charts: the replicas' figures polled every few seconds, the last 100 samples kept.
  function live() {
    var source = document.getElementById("engine-live");
    if (!source || typeof uPlot === "undefined") { return; }
    var url = source.getAttribute("data-source"), every = +source.getAttribute("data-interval") || 3000;
    var times = [], samples = {}, liveCharts = {};
    // The samples' span, at least the last minute: uPlot widens a single sample's axis to years (from the data,
    // not from the bounds it passes).
    function lastMinute() {
      var first = times[0], last = times[times.length - 1];
      return [Math.min(first, last - 60), last];
    }
    function redraw() {
      var names = Object.keys(samples).sort();
      document.querySelectorAll("[data-live]").forEach(function (node) {
        var kind = node.getAttribute("data-live"), series = [{}], columns = [times.slice()];
        names.forEach(function (name, i) {
          var color = GROUP_COLORS[i % GROUP_COLORS.length];
          if (kind === "requests") {
            series.push(line(name + " running", color));
            columns.push(samples[name].map(function (s) { return s.running; }));
            series.push(line(name + " waiting", color, null, {dash: [5, 3]}));
            columns.push(samples[name].map(function (s) { return s.waiting; }));
          } else {
            var scale = kind === "kv_cache" || kind === "acceptance" ? 100 : 1;
            series.push(line(name, color));
            columns.push(samples[name].map(function (s) { return s[kind] == null ? null : s[kind] * scale; }));
          }
        });
        if (liveCharts[kind] && liveCharts[kind].series.length === series.length) {
          liveCharts[kind].setData(columns);
        } else {
          if (liveCharts[kind]) { liveCharts[kind].destroy(); }
          node.innerHTML = "";
          liveCharts[kind] = new uPlot({width: Math.max(node.clientWidth, 300), height: 180, series: series,
                                        scales: {x: {time: true, range: lastMinute}}, axes: [{}, yAxis(50)]},
                                       columns, node);
        }
        node.setAttribute("data-drawn", String(times.length));
      });
    }
    function poll() {
      fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}})
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (data) {
          if (!data) { return; }
          times.push(data.t);
          Object.keys(data.replicas).forEach(function (name) {
            if (!samples[name]) { samples[name] = times.slice(0, -1).map(function () { return {}; }); }
          });
          Object.keys(samples).forEach(function (name) { samples[name].push(data.replicas[name] || {}); });
          if (times.length > 100) { times.shift(); Object.keys(samples).forEach(function (n) { samples[n].shift(); }); }
          redraw();
        })
        .catch(function () {})
        .then(function () { setTimeout(poll, every); });
    }
    poll();
  }
  document.addEventListener("DOMContentLoaded", live);
  // Forms that ask first (deleting an SLO).
  document.addEventListener("submit", function (event) {
    var message = event.target.getAttribute && event.target.getAttribute("data-confirm");
    if (message && !window.confirm(message)) { event.preventDefault(); }
  });
  // Selects that apply at once (the project switcher): submit their form on change.
  document.addEventListener("change", function (event) {
    if (event.target.matches && event.target.matches("select[data-autosubmit]")) { event.target.form.submit(); }
  });
  document.addEventListener("htmx:afterSwap", draw);
})();
