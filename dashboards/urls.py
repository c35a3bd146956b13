"""The dashboard's routes (the stable URLs of docs/dashboard.md). A new page: its view, a route here, an entry in nav.PAGES."""
from django.contrib.auth import views as auth_views
from django.urls import path

from . import alert_views, channel_views, engine_views, regression_views, rollout_views, slo_views, tuning_views, views

urlpatterns = [
    path("", views.overview, name="overview"),
    path("requests/", views.requests_explorer, name="requests"),
    path("traces/<str:trace_id>", views.trace_detail, name="trace"),
    path("slos/", slo_views.slo_list, name="slos"),
    path("slos/new", slo_views.slo_form, name="slo-new"),
    path("slos/<slug:name>/", slo_views.slo_detail, name="slo"),
    path("slos/<slug:name>/edit", slo_views.slo_form, name="slo-edit"),
    path("slos/<slug:name>/delete", slo_views.slo_delete, name="slo-delete"),
    path("alerts/", alert_views.alert_list, name="alerts"),
    path("alerts/<str:fingerprint>/", alert_views.alert_detail, name="alert"),
    path("silences/<int:silence_id>/expire", alert_views.silence_expire, name="silence-expire"),
    path("channels/", channel_views.channel_list, name="channels"),
    path("channels/new", channel_views.channel_create, name="channel-new"),
    path("channels/<int:channel_id>/", channel_views.channel_detail, name="channel"),
    path("engine/", engine_views.engine, name="engine"),
    path("engine/metrics.json", engine_views.engine_metrics, name="engine-metrics"),
    path("regressions/", regression_views.regressions, name="regressions"),
    path("regressions/new", regression_views.run_create, name="regression-new"),
    path("regressions/import", regression_views.dataset_import, name="regression-import"),
    path("regressions/runs/<int:run_id>/", regression_views.run_detail, name="regression-run"),
    path("regressions/runs/<int:run_id>/cancel", regression_views.run_cancel, name="regression-cancel"),
    path("regressions/datasets/<slug:name>/", regression_views.dataset_detail, name="regression-dataset"),
    path("tuning/", tuning_views.studies, name="tuning"),
    path("tuning/new", tuning_views.study_create, name="tuning-new"),
    path("tuning/<int:study_id>/", tuning_views.study_detail, name="tuning-study"),
    path("tuning/<int:study_id>/cancel", tuning_views.study_cancel, name="tuning-cancel"),
    path("tuning/<int:study_id>/propose", tuning_views.study_propose, name="tuning-propose"),
    path("rollouts/", rollout_views.rollouts, name="rollouts"),
    path("rollouts/new", rollout_views.rollout_create, name="rollout-new"),
    path("rollouts/<int:rollout_id>/", rollout_views.rollout_detail, name="rollout"),
    path("rollouts/<int:rollout_id>/<slug:action>", rollout_views.rollout_control, name="rollout-control"),
    path("accounts/login/", auth_views.LoginView.as_view(template_name="dashboards/login.html",
                                                         redirect_authenticated_user=True), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
]
